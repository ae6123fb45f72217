"""Structured output with speculation on: the grammar masks the target's distribution, drafts it
forbids are never verified, and greedy output equals constrained plain decoding — on the bundled
demo model (its byte-level BPE tokenizer can spell JSON)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.engine.coordinator import Engine
from actors.engine.grammar import Grammars, unpack
from actors.engine.sequence import SamplingParams
from actors.engine.steplog import read_steps
from actors.target.checkpoint import load_model
from actors.target.model import ForwardBatch
from deployments.settings import ServeSettings

pytestmark = pytest.mark.usefixtures("local_ray")  # tests/actors/conftest.py

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "size": {"type": "integer"}, "tags": {"type": "array", "maxItems": 2,
                                                                                 "items": {"type": "string",
                                                                                           "maxLength": 6}}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
CONSTRAINTS = [("json_schema", json.dumps(SCHEMA)), ("json_object", ""), ("regex", r"(def|class) [a-z_]{1,12}\(\)"),
               ("choice", json.dumps(["import os", "import sys", "from typing import Any"]))]
PROMPTS = ["config = ", "    return ", "# the main entry point\n", "#!/usr/bin/env python\n"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cfg = ServeSettings(cost_model_cache=str(tmp_path_factory.mktemp("cache")), max_running=8, block=8,
                        threads_per_rank=2, drafter="block").engine_config()  # drafts for any prompt
    return cfg


def constrained_plain(model, grammars: Grammars, prompt: list[int], kind: str, spec: str, max_tokens: int,
                      eos: int) -> list[int]:
    """Plain greedy decoding under the grammar, one token at a time."""
    g = grammars.matcher(kind, spec)
    out: list[int] = []
    while len(out) < max_tokens:
        with torch.no_grad():
            logits, _ = model(ForwardBatch.from_lists([0], [[*prompt, *out]], "last"), model.new_cache(512))
        row = logits[0].numpy().copy()
        row[~unpack(g.masks(np.zeros(0, dtype=np.int64)), len(row))[0]] = -np.inf
        out.append(int(np.argmax(row)))
        if out[-1] == eos:
            break
        g.commit(out[-1:])
    return out


def test_constrained_greedy_output_parses_and_equals_constrained_plain_decoding(demo, tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(demo.tokenizer_path)
    prompts = [tok.encode(p).ids for p in PROMPTS]
    model = load_model(demo.target_dir).eval()
    grammars = Grammars(demo.tokenizer_path, model.cfg.vocab_size, demo.eos_token_id)
    want = [constrained_plain(model, grammars, p, kind, spec, 48, demo.eos_token_id)
            for p, (kind, spec) in zip(prompts, CONSTRAINTS, strict=True)]
    log = tmp_path / "steps.msgpack"
    import dataclasses

    eng = Engine(dataclasses.replace(demo, step_log=str(log)))
    try:
        for policy in ("ar", "full", "dcut"):
            eng.set_policy(policy)
            out = eng.generate(prompts, [SamplingParams(max_tokens=48, constraint=c) for c in CONSTRAINTS])
            assert [s.output for s in out] == want, policy
            assert [s.finish_reason for i, s in enumerate(out) if i != 1] == ["stop"] * 3  # (1 may run long)
            obj = json.loads(tok.decode(out[0].output[:-1]))  # EOS ends it
            assert set(obj) == {"name", "size", "tags"} and isinstance(obj["size"], int)
            if out[1].finish_reason == "stop":
                assert isinstance(json.loads(tok.decode(out[1].output[:-1])), dict)
            assert tok.decode(out[2].output[:-1]).endswith("()")
            assert tok.decode(out[3].output[:-1]) in {"import os", "import sys", "from typing import Any"}
            if policy == "full":  # `full` keeps every draft, except those the grammar forbids
                steps = [s for s in read_steps(log) if s["policy"] == "full"]
                assert sum(sum(s["kept"]) for s in steps) > 0
                assert any(k < d for s in steps for k, d in zip(s["kept"], s["drafted"], strict=True))
    finally:
        eng.shutdown()


def test_sampled_constrained_output_always_parses(demo):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(demo.tokenizer_path)
    eng = Engine(demo)
    try:
        eng.set_policy("full")
        prompt = tok.encode(PROMPTS[0]).ids
        out = eng.generate([prompt] * 8, [SamplingParams(max_tokens=96, temperature=0.7, seed=s,
                                                         constraint=CONSTRAINTS[0]) for s in range(8)])
    finally:
        eng.shutdown()
    done = [s for s in out if s.finish_reason == "stop"]
    assert len(done) >= 6
    for s in done:
        obj = json.loads(tok.decode(s.output[:-1]))
        assert set(obj) == {"name", "size", "tags"} and len(obj["name"]) <= 10


def test_constraints_are_checked_before_they_reach_a_step(demo):
    grammars = Grammars(demo.tokenizer_path, 4096, demo.eos_token_id)
    assert all(grammars.check(kind, spec) is None for kind, spec in CONSTRAINTS)
    assert "regex" in grammars.check("regex", "[a-z")
    assert grammars.check("json_schema", "{not json") is not None
    assert grammars.check("lark", "start: undefined_rule") is not None
