"""The checkpoint's chat template, applied as Hugging Face's tokenizer applies it."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from deployments.bundle import BUNDLED
from deployments.chat_template import ChatTemplate, ChatTemplateError

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w9 w10 w11"},
                {"role": "assistant", "content": "w12"}, {"role": "user", "content": "and then?"}]

# A ChatML template with the features real ones use: a default system turn, whitespace control,
# raise_exception, and special-token variables.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ bos_token }}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_render(folder, messages) -> str:
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_bundled_template_is_the_demo_models_role_tagged_lines_as_transformers_renders_it():
    ours = ChatTemplate.load(BUNDLED).render(CONVERSATION)
    assert ours == ("<|system|>\nbe brief\n<|user|>\nw9 w10 w11\n<|assistant|>\nw12\n<|user|>\nand then?\n"
                    "<|assistant|>\n")
    assert ours == hf_render(BUNDLED, CONVERSATION)


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:], [{"role": "user", "content": "  hi  "}]])
def test_a_chatml_template_renders_token_for_token_as_transformers(tmp_path, messages):
    (tmp_path / "tokenizer.json").write_bytes((BUNDLED / "tokenizer.json").read_bytes())
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
           "chat_template": [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "x"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate.load(tmp_path).render(messages) == hf_render(tmp_path, messages)
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate.load(tmp_path).render([{"role": "tool", "content": "x"}])


def test_a_folder_without_a_template_has_none(tmp_path):
    assert ChatTemplate.load(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.load(tmp_path) is None
