"""Train the demo BPE tokenizer (byte-level, HF `tokenizers`) on the corpus's training split, and
write its `tokenizer_config.json` beside it (special tokens, and the chat template the server
applies: role-tagged lines, then the assistant's turn)."""

from __future__ import annotations

import argparse
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deployments.corpus import texts

EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def tokenizer_config(max_length: int = 2048) -> dict:
    """What Hugging Face loaders (and `deployments.chat_template`) read beside tokenizer.json."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
            "model_max_length": max_length, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}


def train_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts("train"), trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="models/demo/tokenizer.json")
    args = ap.parse_args()
    tok = train_tokenizer(args.vocab)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    config = pathlib.Path(args.out).with_name("tokenizer_config.json")
    config.write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"vocabulary {tok.get_vocab_size()} -> {args.out}, {config}")


if __name__ == "__main__":
    main()
