"""The MTP (DeepSeek-V3 next-n) drafter: weights in DeepSeek's layout, incremental drafting equal
to a naive full recompute, and lossless in the engine whatever it drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from actors.drafter.kinds import BuildArgs, kind
from actors.drafter.mtp import WEIGHTS, DraftVocabulary, MTPConfig, MTPDrafter, MTPModule
from actors.drafter.target_parts import shared_embeddings, target_final_norm
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from actors.target.model import ForwardBatch
from dcut_core.chains import ChainStop, cut_lengths
from tests.conftest import tiny_mtp

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [40, 41, 42, 40, 41], [3, 4, 3, 4, 3, 4]]


def naive_drafts(module: MTPModule, norm, model, tokens: list[int], k: int,
                 vocab: list[int] | None = None) -> list[int]:
    """Recompute everything from scratch: the target's normed states of every committed
    position, all pairs with full causal attention, then k greedy chain steps."""
    with torch.no_grad():
        _, captured = model(ForwardBatch.from_lists([0], [tokens[:-1]], "last"), model.new_cache(256),
                            capture_layers=(3,))
    return naive_chain(module, tokens, norm(captured[3]), k, vocab)


def naive_chain(module, tokens: list[int], hidden: torch.Tensor, k: int, vocab: list[int] | None = None) -> list[int]:
    """k greedy drafts of a chained module (MTP, EAGLE-3) from scratch: pairs (token j + 1, state
    j) for every committed position, full causal attention, each draft appended with the module's
    own output as its state. vocab: the tokens it may draft (the argmax over the full vocabulary's
    logits restricted to them)."""
    with torch.no_grad():
        toks, hid, out = list(tokens[1:]), [*hidden], []
        for _ in range(k):
            x = module.combine(torch.tensor(toks), torch.stack(hid))
            n = len(toks)
            q, kk, v = module.qkv(x, torch.arange(1, n + 1))
            rep = module.heads // module.kv_heads
            keys, values = (t.repeat_interleave(rep, 1).transpose(0, 1)[None] for t in (kk, v))
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=True,
                                                  scale=getattr(module, "scale", None))
            g = module.finish(x, attn[0].transpose(0, 1).reshape(n, -1))
            logits = module.logits(g[-1])
            nxt = int(logits.argmax()) if vocab is None else vocab[int(logits[vocab].argmax())]
            out.append(nxt)
            toks.append(nxt)
            hid.append(g[-1])
    return out


def test_incremental_drafting_equals_a_naive_full_recompute(tiny_bundle, tmp_path):
    target_dir = f"{tiny_bundle}/target"
    module = tiny_mtp(target_dir, tmp_path / "mtp")
    loaded = MTPModule.load(tmp_path / "mtp", *shared_embeddings(target_dir))
    norm, model = target_final_norm(target_dir), load_model(target_dir).eval()
    drafter = MTPDrafter(loaded, norm, target_layer=3, capacity_tokens=4096, block=6)
    local = LocalTarget(model)
    # Commit each prompt in two pieces, every request in the same call, as the engine's catch-ups
    # would: tokens, and the target's states at the positions it has processed (all but the newest).
    pieces = []
    for rid, p in enumerate(PROMPTS):
        rows = local.forward([rid], [p[:-1]], capture_layers=(3,)).features[0][3]
        half = max(1, len(p) // 2)
        pieces.append(((p[:half], {3: rows[:half]}), (p[half:], {3: rows[half:]} if len(rows) > half else {})))
    for piece in (0, 1):
        drafter.commit(list(range(len(PROMPTS))), [x[piece][0] for x in pieces], [x[piece][1] for x in pieces])
    got = drafter.draft(list(range(len(PROMPTS))), [p[-1] for p in PROMPTS], [5, 3, 1, 4])
    for i, p in enumerate(PROMPTS):
        want = naive_drafts(module, norm, model, p, [5, 3, 1, 4][i])
        assert got.tokens[got.cu[i]:got.cu[i + 1]].tolist() == want
    assert np.all((got.confidence > 0) & (got.confidence <= 1)) and np.all(got.margin >= 0)
    check_chain_cut(drafter, got, [5, 3, 1, 4])
    drafter.release([0])
    assert drafter.draft([0], [5], [3]).cu.tolist() == [0, 0]  # no context: no drafts


def test_a_draft_vocabulary_drafts_only_its_tokens(tiny_bundle, tmp_path):
    """With a draft vocabulary the chain is the greedy chain over those tokens only (a naive
    recompute restricted to them agrees), it differs from the unrestricted chain where that one
    drafts a token outside the vocabulary, and it is loaded with the module's folder."""
    target_dir = f"{tiny_bundle}/target"
    module = tiny_mtp(target_dir, tmp_path / "mtp")
    norm, model = target_final_norm(target_dir), load_model(target_dir).eval()
    local = LocalTarget(model)

    def drafts(vocab):
        drafter = MTPDrafter(MTPModule.load(tmp_path / "mtp", *shared_embeddings(target_dir)), norm, target_layer=3,
                             capacity_tokens=4096, block=6, vocab=vocab)
        for rid, p in enumerate(PROMPTS):
            drafter.commit([rid], [p], [{3: local.forward([rid], [p[:-1]], capture_layers=(3,)).features[0][3]}])
            local.cache.release_all([rid])
        return drafter, drafter.draft(list(range(len(PROMPTS))), [p[-1] for p in PROMPTS], [5, 3, 1, 4])

    _, full = drafts(None)
    used = set(full.tokens.tolist())
    ids = [t for t in range(module.vocab_size) if t not in used][::-1]  # every token the full chain did not draft
    drafter, got = drafts(DraftVocabulary(torch.tensor(ids)))
    assert set(got.tokens.tolist()) <= set(ids) and got.tokens.tolist() != full.tokens.tolist()
    for i, p in enumerate(PROMPTS):
        want = naive_drafts(module, norm, model, p, [5, 3, 1, 4][i], ids)
        assert got.tokens[got.cu[i]:got.cu[i + 1]].tolist() == want
    assert np.all((got.confidence > 0) & (got.confidence <= 1))
    check_chain_cut(drafter, got, [5, 3, 1, 4])

    DraftVocabulary(torch.tensor(ids)).save(tmp_path / "mtp")
    built = kind("mtp").build(BuildArgs(target_dir, str(tmp_path / "mtp"), 4096, 6))
    assert built.vocab is not None and built.vocab.ids.tolist() == ids
    with pytest.raises(ValueError, match="distinct"):
        DraftVocabulary(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="the target has"):
        MTPDrafter(module, norm, 3, vocab=DraftVocabulary(torch.tensor([module.vocab_size])))
    counts = np.zeros(module.vocab_size)
    counts[[7, 3, 9]] = [5, 9, 5]
    assert DraftVocabulary.from_counts(counts, 3).ids.tolist() == [3, 7, 9]  # ties by id


def check_chain_cut(drafter: MTPDrafter, full, wanted: list[int]) -> None:
    """The chain cut as it runs (`stop`) keeps a prefix of the uncut drafts, as long as the cut
    computed on the host from the uncut drafts' confidences says (dcut_core/chains.py)."""
    rids, last = list(range(len(PROMPTS))), [p[-1] for p in PROMPTS]
    n = max(wanted)
    conf, margin = np.zeros((len(rids), n)), np.zeros((len(rids), n))
    for i in rids:
        row = slice(full.cu[i], full.cu[i + 1])
        conf[i, :wanted[i]], margin[i, :wanted[i]] = full.confidence[row], full.margin[row]
    never = ChainStop((0.0, 1.0, 0.0, 0.0), 6, 0.0, 0.0)
    same = drafter.draft(rids, last, wanted, stop=never)
    assert same.tokens.tolist() == full.tokens.tolist() and np.allclose(same.confidence, full.confidence)
    once = drafter.draft(rids, last, wanted, stop=ChainStop((0.0, 1.0, 0.0, 0.0), 6, 0.0, 1e9))
    assert np.diff(once.cu).tolist() == [1] * len(rids)  # no request can pay a second pass
    assert once.tokens.tolist() == [full.tokens[full.cu[i]] for i in rids]
    survival = np.sort(np.cumprod(conf, axis=1)[conf > 0])
    gap = int(np.argmax(np.diff(survival)))
    rule = ChainStop((0.0, 1.0, 0.0, 0.0), 6, float(survival[gap:gap + 2].mean()), 0.0)  # far from every survival
    cut = drafter.draft(rids, last, wanted, stop=rule)
    expect, _ = cut_lengths(rule, np.array(wanted), conf, margin)
    assert np.diff(cut.cu).tolist() == expect.tolist() and expect.sum() < sum(wanted)
    for i in rids:
        assert cut.tokens[cut.cu[i]:cut.cu[i + 1]].tolist() == full.tokens[full.cu[i]:full.cu[i] + expect[i]].tolist()


def test_deepseek_layout_loads_and_a_foreign_head_is_refused(tiny_bundle, tmp_path):
    target_dir = f"{tiny_bundle}/target"
    tiny_mtp(target_dir, tmp_path / "mtp")
    tensors = load_file(str(tmp_path / "mtp" / WEIGHTS))
    names = {k.removeprefix("model.layers.3.") for k in tensors}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "self_attn.q_proj.weight", "mlp.down_proj.weight",
            "shared_head.norm.weight", "shared_head.head.weight"} <= names
    embed, head = shared_embeddings(target_dir)
    tensors["model.layers.3.embed_tokens.weight"] = embed.weight.detach().clone()  # DeepSeek stores it too
    tensors["model.layers.2.mlp.gate.weight"] = torch.zeros(1)  # another layer's weights are not ours
    cfg = MTPConfig.load(tmp_path / "mtp" / "mtp_config.json")
    MTPModule.from_tensors(cfg, tensors, embed, head)
    tensors["model.layers.3.shared_head.head.weight"] = torch.randn_like(head.weight)
    with pytest.raises(ValueError, match="differs from the target"):
        MTPModule.from_tensors(cfg, tensors, embed, head)
    tensors["model.layers.3.shared_head.head.weight"] = head.weight.detach().clone()
    save_file({k: v for k, v in tensors.items() if "eh_proj" not in k}, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        MTPModule.from_tensors(cfg, load_file(str(tmp_path / "broken.safetensors")), embed, head)


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("ep", [1, 2])
def test_mtp_drafts_are_verified_losslessly(tiny_bundle, tmp_path, ep):
    target_dir = f"{tiny_bundle}/target"
    module = tiny_mtp(target_dir, tmp_path / "mtp")
    reference = greedy_decode(LocalTarget(load_model(target_dir)), list(range(len(PROMPTS))), PROMPTS, 12)
    # At EP 2 the chains are cut as they run (`chain_stop`): the rule crosses the control link; and
    # the module drafts over half the vocabulary (a draft vocabulary in its folder).
    if ep == 2:
        DraftVocabulary(torch.arange(module.vocab_size // 2)).save(tmp_path / "mtp")
    eng = Engine(EngineConfig(target_dir=target_dir, drafter="mtp", drafter_dir=str(tmp_path / "mtp"), block=6,
                              policy="full", ep=ep, cost_model_cache=str(tmp_path), chain_stop=ep == 2))
    try:
        for policy in ("full", "dcut", "ar"):
            eng.set_policy(policy)
            out = eng.generate(PROMPTS, [SamplingParams(max_tokens=12)] * len(PROMPTS))
            assert [s.output for s in out] == reference, policy
            if policy == "full":
                assert sum(sum(s.drafted) for s in out) > 0
    finally:
        eng.shutdown()
