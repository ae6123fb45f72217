"""The target model in one process: HF compatibility, ragged forward, KV cache, rollback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from actors.target.checkpoint import load_model, save_model
from actors.target.config import MoEConfig
from actors.target.kv_cache import KVCacheFull
from actors.target.local import LocalTarget
from actors.target.model import ForwardBatch


def run(model, chunks, capacity=2048):
    logits, _ = model(ForwardBatch.from_lists(list(range(len(chunks))), chunks), model.new_cache(capacity))
    return logits


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_logits_equal_transformers_qwen3_moe(tmp_path, make_tiny, layout):
    model = make_tiny(1)
    save_model(model, tmp_path, layout=layout, max_shard_bytes=60_000 if layout == "per_expert" else None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (layout == "per_expert")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = [3, 17, 5, 90, 41, 8, 8, 60, 2]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(run(model, [tokens]), ref, rtol=1e-5, atol=1e-5)
    loaded = load_model(tmp_path)
    torch.testing.assert_close(run(loaded, [tokens]), ref, rtol=1e-5, atol=1e-5)


def test_checkpoint_written_by_transformers_loads(tmp_path):
    cfg = transformers.Qwen3MoeConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    tokens = [1, 2, 3, 4, 70, 6]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(run(load_model(tmp_path), [tokens]), ref, rtol=1e-5, atol=1e-5)


def test_qwen2_moe_shared_expert_matches_transformers(tmp_path):
    cfg = transformers.Qwen2MoeConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(1)
    hf = transformers.Qwen2MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    tokens = [5, 9, 13, 2, 77]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    model = load_model(tmp_path)
    assert model.moe_blocks()[0].shared_expert is not None
    torch.testing.assert_close(run(model, [tokens]), ref, rtol=1e-5, atol=1e-5)


def test_ragged_batch_equals_separate_requests_and_chunked_prefill(make_tiny):
    model = make_tiny()
    chunks = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12]]
    together = run(model, chunks)
    separate = torch.cat([run(model, [c]) for c in chunks])
    torch.testing.assert_close(together, separate, rtol=1e-5, atol=1e-5)
    cache = model.new_cache(512, block_size=4)  # small blocks: chunks straddle block edges
    parts = [model(ForwardBatch.from_lists([0], [c]), cache)[0] for c in ([1, 2, 3], [4, 5], [6, 7])]
    torch.testing.assert_close(torch.cat(parts), together[:7], rtol=1e-5, atol=1e-5)


def test_logits_only_at_requested_positions(make_tiny):
    model = make_tiny()
    full = run(model, [[1, 2, 3, 4]])
    out = LocalTarget(model).forward([7], [[1, 2, 3, 4]], logits=[[1, 3]], with_logits=True)
    torch.testing.assert_close(torch.from_numpy(out.logits), full[[1, 3]], rtol=1e-6, atol=1e-6)


def test_rollback_of_rejected_drafts(make_tiny):
    model = make_tiny()
    target = LocalTarget(model, kv_capacity_tokens=256, kv_block_size=4)
    target.forward([1], [[5, 6, 7]])
    target.forward([1], [[8, 9, 10, 11, 12, 13]])  # three drafts... all rejected
    free_before = target.cache.free_tokens
    target.truncate({1: 3})
    assert target.cache.length(1) == 3 and target.cache.free_tokens > free_before
    after = target.forward([1], [[20, 21]], with_logits=True).logits
    fresh = LocalTarget(model).forward([1], [[5, 6, 7, 20, 21]], with_logits=True).logits[3:]
    torch.testing.assert_close(torch.from_numpy(after), torch.from_numpy(fresh), rtol=1e-5, atol=1e-5)


def test_kv_capacity_is_enforced_without_corruption(make_tiny):
    model = make_tiny()
    target = LocalTarget(model, kv_capacity_tokens=32, kv_block_size=8)
    target.forward([1], [list(range(1, 21))])  # 3 blocks of 4
    free = target.cache.free_tokens
    with pytest.raises(KVCacheFull, match="KV cache full"):
        target.forward([1, 2], [[1, 2, 3], list(range(1, 12))])
    assert target.cache.length(1) == 20 and 2 not in target.cache and target.cache.free_tokens == free
    target.forward([1], [[1, 2, 3, 4]])  # still serving
    with pytest.raises(ValueError, match="token ids"):
        target.forward([1], [[96]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LocalTarget(model, kv_capacity_tokens=2048).forward([3], [[1] * 513])


def test_expert_slice_loading(tiny_checkpoint):
    part = load_model(tiny_checkpoint, first_expert=4, local_experts=4)
    full = load_model(tiny_checkpoint)
    block_p, block_f = part.moe_blocks()[0], full.moe_blocks()[0]
    assert block_p.experts.gate_up.shape[0] == 4
    torch.testing.assert_close(block_p.experts.gate_up, block_f.experts.gate_up[4:])
    with pytest.raises(ValueError, match="expert range"):
        load_model(tiny_checkpoint, first_expert=6, local_experts=4)


def test_config_rejects_what_we_cannot_run_exactly(tmp_path):
    good = MoEConfig(8, 8, 1, 1, 1, 8, 8, 8, 2, 1).to_dict()
    with pytest.raises(ValueError, match="rope scaling"):
        MoEConfig.from_dict(good | {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        MoEConfig.from_dict(good | {"model_type": "llama"})
    with pytest.raises(ValueError, match="sliding"):
        MoEConfig.from_dict(good | {"use_sliding_window": True})
    assert MoEConfig.from_dict(good) == MoEConfig(8, 8, 1, 1, 1, 8, 8, 8, 2, 1)



def assert_a_mixed_step_equals_its_parts(model) -> None:
    """Requests appending a few tokens attend as one padded batch, chunks longer than
    `QUERY_SPAN` in groups of like length (`plan_attention`): a step holding both gives every
    row what the parts give forwarded apart, and leaves the cache as they do."""
    from actors.target.layers import QUERY_SPAN

    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 5)]
    steps = [[1, 2], [3], [4, 5, 6]]  # decoding requests: a token and drafts
    long = torch.randint(0, vocab, (QUERY_SPAN + 9,), generator=g).tolist()
    longer = torch.randint(0, vocab, (3 * QUERY_SPAN,), generator=g).tolist()
    mixed, apart = LocalTarget(model), LocalTarget(model)
    for t in (mixed, apart):
        t.forward([0, 1, 2], prompts)
    def logits(out) -> list[np.ndarray]:
        return out.split(out.logits)

    both = logits(mixed.forward([0, 7, 1, 8, 2], [steps[0], long, steps[1], longer, steps[2]], with_logits=True))
    short = logits(apart.forward([0, 1, 2], steps, with_logits=True))
    chunks = logits(apart.forward([7, 8], [long, longer], with_logits=True))
    for got, want in zip(both, [short[0], chunks[0], short[1], chunks[1], short[2]], strict=True):
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=1e-5)
    after = [logits(t.forward([0, 7], [[9], [9]], with_logits=True)) for t in (mixed, apart)]
    for a, b in zip(*after, strict=True):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-5)


def test_a_step_mixing_decoding_rows_and_long_prompt_chunks_equals_its_parts(make_tiny):
    assert_a_mixed_step_equals_its_parts(make_tiny())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_one_matmul_per_expert(make_tiny, dtype, monkeypatch):
    """The experts as two grouped matmuls (the GPU path, `F.grouped_mm`, which torch also runs
    on the CPU) give the loop's logits bit for bit: a prefill, then a decode step of two tokens
    (most experts get no rows: empty groups). The loop multiplies by `F.linear` here, as it does
    off the CPU (on the CPU it poses small products its own way: actors/target/layout.py)."""
    import torch.nn.functional as F

    from actors.target.moe import grouped_mm_runs

    monkeypatch.setattr("actors.target.moe.cpu_linear", F.linear)

    if not grouped_mm_runs("cpu", dtype):
        pytest.skip(f"torch {torch.__version__} has no grouped matmul on the CPU in {dtype}")
    model = make_tiny(3).to(dtype)
    runs = {}
    for grouped in (False, True):
        for block in model.moe_blocks():
            block.experts.grouped = grouped
        cache = model.new_cache(2048)
        with torch.no_grad():
            prefill, _ = model(ForwardBatch.from_lists([0, 1], [[3, 17, 5, 90, 41], [8]]), cache)
            step, _ = model(ForwardBatch.from_lists([0, 1], [[2], [60]]), cache)
        runs[grouped] = (prefill, step)
    for loop, grouped in zip(runs[False], runs[True], strict=True):
        assert torch.equal(loop, grouped)
    assert 2 * model.cfg.num_experts_per_tok < model.cfg.num_experts  # the decode step leaves experts idle


def test_the_caches_slot_arrays_equal_its_per_request_slots():
    """`slot_rows` and `slots_between` (one numpy expression for a whole step) against `slots`,
    one request at a time, over requests whose blocks interleave and were freed and reused."""
    from actors.target.kv_cache import CacheSpec, PagedKVCache

    rng = np.random.default_rng(7)
    cache = PagedKVCache(CacheSpec(1, 1, 4, 4096, block_size=16))
    lengths = {}
    for _ in range(6):  # grow, truncate and release in turns: tables of scattered blocks
        grow = {rid: int(rng.integers(1, 40)) for rid in rng.choice(12, 6, replace=False).tolist()}
        cache.reserve(grow)
        for rid, n in grow.items():
            cache.commit(rid, n)
            lengths[rid] = lengths.get(rid, 0) + n
        rid = int(rng.choice(list(lengths)))
        if rng.random() < 0.5:
            lengths[rid] = int(rng.integers(0, lengths[rid] + 1))
            cache.truncate(rid, lengths[rid])
        else:
            cache.release(rid)
            del lengths[rid]
    ids = list(lengths)
    ends = np.array([lengths[r] for r in ids])
    starts = np.array([int(rng.integers(0, e + 1)) for e in ends])
    width = int(ends.max()) + 5
    rows = cache.slot_rows(ids, ends, width)
    for i, rid in enumerate(ids):
        assert rows[i, :ends[i]].tolist() == cache.slots(rid, 0, int(ends[i])).tolist()
        assert not rows[i, ends[i]:].any()
    flat = torch.cat([cache.slots(rid, int(s), int(e)) for rid, s, e in zip(ids, starts, ends, strict=True)])
    assert cache.slots_between(ids, starts, ends).tolist() == flat.tolist()
    assert cache.slots_between(ids, ends, ends).tolist() == []


def test_requests_of_widely_different_shapes_attend_in_groups_and_equal_each_alone(make_tiny, monkeypatch):
    """Decoding requests whose contexts run from 6 to 300 tokens and whose chunks from 1 to 8 attend
    in groups that pad fewer (query, key) pairs (`split_padded`): a step of 40 of them gives every
    row what each request gives forwarded alone, the grouping is what the step used, and one padded
    group gives the same."""
    import actors.target.layers as layers
    import actors.target.model as forward

    model = make_tiny()
    g = torch.Generator().manual_seed(3)
    vocab = model.cfg.vocab_size
    contexts = [6 + (i * 97) % 295 for i in range(40)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in contexts]
    steps = [torch.randint(0, vocab, (8 if i % 5 == 0 else 1 + i % 3,), generator=g).tolist() for i in range(40)]
    lengths = np.array([len(s) for s in steps])
    assert len(contexts) >= layers.GROUP_FROM
    groups = layers.split_padded(np.arange(40), np.array(contexts) + lengths, lengths)
    assert len(groups) > 1 and sorted(np.concatenate(groups).tolist()) == list(range(40))
    assert all(len(x) >= layers.GROUP_LEAST for x in groups)
    seen = []
    plan = forward.plan_attention
    monkeypatch.setattr(forward, "plan_attention", lambda *a, **k: seen.append(p := plan(*a, **k)) or p)

    def step(target) -> list[np.ndarray]:
        target.forward(list(range(40)), prompts)
        out = target.forward(list(range(40)), steps, with_logits=True)
        return out.split(out.logits)

    grouped = step(LocalTarget(model, kv_capacity_tokens=32768))
    assert len(seen[-1].groups) == len(groups)
    monkeypatch.setattr(layers, "GROUP_SAVING", 2.0)  # never cut: one padded group
    padded = step(LocalTarget(model, kv_capacity_tokens=32768))
    assert len(seen[-1].groups) == 1
    for i in range(40):
        alone = LocalTarget(model, kv_capacity_tokens=1024)
        alone.forward([i], [prompts[i]])
        out = alone.forward([i], [steps[i]], with_logits=True)
        want = torch.from_numpy(out.split(out.logits)[0])
        torch.testing.assert_close(torch.from_numpy(grouped[i]), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(padded[i]), want, rtol=1e-5, atol=1e-5)


def test_the_cut_pads_the_fewest_pairs_by_keys_or_by_queries_and_leaves_like_shapes_alone():
    from actors.target.layers import GROUP_LEAST, split_padded

    def cut(ends, lengths):
        return [sorted(p.tolist()) for p in split_padded(np.arange(len(ends)), np.array(ends), np.array(lengths))]

    assert cut([10] * 8 + [400] * 8, [2] * 16) == [list(range(8)), list(range(8, 16))]  # by keys
    by_queries = [[i for i in range(16) if i % 4 != 3], list(range(3, 16, 4))]
    assert cut([200] * 16, [1, 1, 1, 8] * 4) == by_queries
    assert len(cut([300] * 16, [8] * 16)) == 1  # nothing to save
    assert len(cut(list(np.arange(2 * GROUP_LEAST - 1) * 100 + 1), [8] * 7)) == 1  # too few requests
    assert len(cut([1] * 8 + [21] * 8, [1] * 16)) == 1  # saves too few pairs to pay a call
