"""The demo target's architecture (the bundled model, issue #4, is trained at this shape).

Until trained weights ship, profiling and benchmarks use random weights of this shape: step
cost depends on shapes, not on weight values (routing of random weights is near uniform, of
trained weights skewed; the profile of the served model is what the engine uses).
"""

from __future__ import annotations

import pathlib

from actors.target.checkpoint import save_model
from actors.target.config import MoEConfig
from actors.target.model import MoETransformer

DEMO_TARGET = MoEConfig(
    vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, intermediate_size=1024, moe_intermediate_size=384, num_experts=8, num_experts_per_tok=2,
    rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True, model_type="qwen3_moe",
    eos_token_id=0,
)


def write_random_demo(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A random-weight checkpoint of the demo shape (for profiling before weights exist)."""
    path = pathlib.Path(path)
    if not (path / "config.json").exists():
        model = MoETransformer(DEMO_TARGET)
        model.init_random(seed)
        save_model(model, path)
    return path
