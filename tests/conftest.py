"""Test-wide set-up.

Keeps every Ray process of the suite on loopback (this runs before any test module imports Ray,
which reads the setting at import time), and makes small random checkpoints in Hugging Face
format once per session (no downloads).
"""

from actors.ray_env import set_local_env

set_local_env()

import json  # noqa: E402

import pytest  # noqa: E402  (after set_local_env on purpose)

from actors.target.checkpoint import save_model  # noqa: E402
from actors.target.config import MoEConfig  # noqa: E402
from actors.target.model import MoETransformer  # noqa: E402
from tools.demo.tokenizer import tokenizer_config  # noqa: E402


def tiny_config(**overrides) -> MoEConfig:
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                mlp_only_layers=(1,), rope_theta=10000.0, max_position_embeddings=512)
    return MoEConfig(**(base | overrides))


def tiny_model(seed: int = 0, **overrides) -> MoETransformer:
    model = MoETransformer(tiny_config(**overrides))
    model.init_random(seed)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "fused"
    save_model(tiny_model(), path, layout="fused")
    return str(path)


@pytest.fixture
def make_tiny():
    return tiny_model


def tiny_drafter_weights(path, target: MoETransformer, block: int = 8, seed: int = 3):
    """Random block-drafter weights for the tiny target, saved like the bundled drafter."""
    import torch

    from actors.drafter.model import DraftConfig, DraftModel

    cfg = DraftConfig(target.cfg.hidden_size, (1, 3), num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=64, block_size=block, rope_theta=target.cfg.rope_theta)
    torch.manual_seed(seed)
    model = DraftModel(cfg, target.embed_tokens, target.lm_head)
    with torch.no_grad():
        model.mask_embedding.normal_()
    model.save(path)
    return model


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> str:
    """A model bundle (target/, drafter/, mtp/, eagle3/) of the tiny model, sharpened so sampling is
    not flat."""
    import torch

    root = tmp_path_factory.mktemp("bundle")
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked next-token distributions: drafts get accepted
    save_model(model, root / "target")
    tiny_drafter_weights(root / "drafter", model)
    tiny_mtp(str(root / "target"), root / "mtp")
    tiny_eagle3(str(root / "target"), root / "eagle3")
    tiny_tokenizer().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))  # the demo's chat template
    return str(root)


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: token i is the word "w{i}"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0} | {f"w{i}": i for i in range(1, 96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def tiny_mtp(target_dir: str, out, seed: int = 0):
    """A random MTP module for the tiny target, saved in DeepSeek's layout under `out`."""
    import torch

    from actors.drafter.mtp import MTPConfig, MTPModule
    from actors.drafter.target_parts import shared_embeddings

    torch.manual_seed(seed)
    embed, head = shared_embeddings(target_dir)
    cfg = MTPConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, layer_index=3)
    module = MTPModule(cfg, embed, head)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0, 0.08)
    module.save(out, dtype=torch.float32)
    return module


def tiny_eagle3(target_dir: str, out, seed: int = 0, draft_vocab: int = 64):
    """A random EAGLE-3 drafter for the tiny target in the speculators layout: features from
    target layers 1, 2, 3, a draft vocabulary of `draft_vocab` of the 96 ids (its head the
    target's rows for them)."""
    import torch

    from actors.drafter.eagle3 import Eagle3Config, Eagle3Module
    from actors.drafter.target_parts import shared_embeddings
    from actors.target.rope import Rotary

    torch.manual_seed(seed)
    embed, head = shared_embeddings(target_dir)
    cfg = Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=96, vocab_size=96, draft_vocab_size=draft_vocab, target_layers=(1, 2, 3),
                       prefix="layers.0.", rotary=Rotary(16, 10000.0))
    module = Eagle3Module(cfg, embed)
    keep = torch.sort(torch.randperm(96)[:draft_vocab]).values
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0, 0.08)
        module.lm_head.weight.copy_(head.weight[keep])
        module.d2t.copy_(keep - torch.arange(draft_vocab))
    module.save(out)
    return module
