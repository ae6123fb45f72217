"""CUDA graphs of a rank's decode and verify forwards (one rank, grouped experts).

On a GPU the bundled model's forward is bound by the host: ~430 kernels launched from Python
take 7.5–15 ms where the device is busy 0.7–1.5 ms (`benchmarks/rank_step.py`, H200,
2026-12-04). Replayed as a CUDA graph the same forward took 1.7–4.5 ms with bit-equal logits.
A graph replays fixed shapes, so a step is padded to a bucket — requests to a power of two,
each request's new tokens to 1, 4, 16 or `QUERY_SPAN` (decoding, verifying, and prefill chunks
of up to `QUERY_SPAN` tokens; a step with a longer chunk runs eagerly, every request of it), its
keys to 256 · 4^i — and the graph of that bucket, captured at start (`warm_up`) or the first time
it is met (70–100 ms), is replayed with the step's inputs copied into the ones it captured. A
graph outputs the states of every layer any step has asked for (the drafters' features), so a
bucket has one graph whichever drafters a step serves. The graphs share one memory pool: a
graph's outputs are valid until the next replay (the rank reads them within its step). The
padding's tokens compute beside the real ones and write their keys to one scratch slot of the
cache; nothing reads them.

A step graphs only where nothing in it waits for the host: one rank (the all-to-all of EP > 1
needs its split sizes on the host) whose experts run as torch's grouped matmul without a host
fallback (bfloat16 on SM 9.x/10.x: `moe.grouped_mm_runs`). Other steps run eagerly, as does
every step with `mode="off"`. `mode="padded"` runs the padded step without capturing, on any
device: what the CPU tests check (the padding is exact), and the replay runs the same kernels.

What a graphed step does not report: the experts each MoE layer touched (`StepStats.per_layer`;
the padding's tokens route too). Its other statistics are the host's, as in an eager step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from actors.target.kv_cache import PagedKVCache
from actors.target.layers import QUERY_SPAN, AttentionGroup, AttentionPlan, Padding, plan_attention
from actors.target.model import MoETransformer, Prepared
from actors.target.moe import StepStats, grouped_mm_runs

MAX_REQUESTS = 256  # larger steps run eagerly (their launches are a small share of their work)
MIN_KEYS = 256  # a bucket of short contexts too: their attention is a sliver of a step, a capture is not
WARM_QUERIES = (1, 4, 16, QUERY_SPAN)  # decoding; verifying up to 3 or 15 drafts; a short prompt admitted
# beside them (17-32 tokens: without it, serving met that bucket in run Z6's padded check)
WARM_KEYS = (MIN_KEYS,)  # prompt and output up to 256 tokens; longer contexts capture their buckets when met
MODES = ("auto", "off", "padded")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow4(n: int, least: int) -> int:
    """The least `least` · 4^i ≥ n: few buckets (a capture costs 70–100 ms on the H200) for at
    most 4 × the work in that dimension (small next to a step's launches on a GPU)."""
    size = least
    while size < n:
        size *= 4
    return size


@dataclass
class _Captured:
    """One bucket's graph: the inputs it reads and the outputs it writes, fixed tensors."""

    inputs: list[torch.Tensor]  # tokens, logit index, then the plan's (`_plan_tensors`)
    layers: tuple[int, ...] = ()  # the layers whose states it outputs (features for the drafters)
    logits: torch.Tensor | None = None  # [padding.tokens, V]
    features: dict[int, torch.Tensor] | None = None  # layer -> [padding.tokens, H]
    graph: torch.cuda.CUDAGraph | None = None  # None: `padded` mode, run eagerly


def _plan_tensors(plan: AttentionPlan) -> list[torch.Tensor]:
    (g,) = plan.groups
    return [plan.write_slots, plan.cos, plan.sin, g.key_slots, g.mask, g.q_index, g.valid]


def _plan_from(tensors: list[torch.Tensor]) -> AttentionPlan:
    write, cos, sin, key_slots, mask, q_index, valid = tensors
    return AttentionPlan(write, [AttentionGroup(key_slots, mask, q_index, valid, None)], cos, sin)


class StepGraphs:
    """A rank's graphed forwards: one per bucket met, at most `max_graphs` (the least recently
    replayed goes first). Owns the cache's scratch slot and the graphs' memory pool."""

    def __init__(self, model: MoETransformer, cache: PagedKVCache, mode: str = "auto", max_graphs: int = 64,
                 warm_requests: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"cuda_graphs must be one of {MODES}, not {mode!r}")
        self.model, self.cache, self.mode, self.max_graphs = model, cache, mode, max_graphs
        self.warm_requests = min(warm_requests, MAX_REQUESTS)
        self._warm = warm_requests <= 0  # warmed up (nothing to warm: buckets are captured as met)
        self.capture = mode == "auto"
        self.scratch = cache.scratch_slot()
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._layers: tuple[int, ...] = ()
        self.captures = self.replays = 0
        self.capture_s = 0.0

    @staticmethod
    def wanted(mode: str, model: MoETransformer, world: int, device: str) -> bool:
        """Whether a rank in this setting graphs its steps (`mode` "auto": where nothing waits for
        the host; "padded": always, uncaptured; "off": never)."""
        if mode == "padded":
            return True
        if mode != "auto" or world != 1 or torch.device(device).type != "cuda" or model.cfg.latent:
            return False
        blocks = model.moe_blocks()
        return all(b.experts.grouped is not False for b in blocks) and (
            not blocks or grouped_mm_runs(device, model.lm_head.weight.dtype, without_host=True))

    def padding(self, prepared: Prepared) -> Padding | None:
        """The bucket of a step, or None where it runs eagerly."""
        lengths, starts = prepared.lengths, prepared.starts
        if not lengths or len(lengths) > MAX_REQUESTS or max(lengths) > QUERY_SPAN:
            return None
        keys = max(s + n for s, n in zip(starts, lengths, strict=True))
        queries = min(_pow4(max(lengths), 1), QUERY_SPAN)  # 1 (decoding), 4, 16, 32 (verifying)
        return Padding(_pow2(len(lengths)), queries, _pow4(keys, MIN_KEYS), self.scratch)

    @torch.inference_mode()
    def forward(self, prepared: Prepared, stats: StepStats | None = None, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """`model.forward` of a prepared step through its bucket's graph: logits [M, V] and the
        captured layers' states [N, H] (views of the graph's outputs: read them before the next
        step). None where the step does not graph (the caller runs it eagerly)."""
        padding = self.padding(prepared)
        if padding is None:
            return None
        t0 = time.perf_counter()
        captures = self.captures
        if not self._warm:
            self.warm_up(capture_layers)
        batch = prepared.batch
        n, m = len(batch.tokens), len(batch.logit_index)
        plan = plan_attention(self.cache, batch.request_ids, batch.cu, prepared.starts, self.model.cfg.rotary,
                              prepared.lengths, padding)
        key = (padding.requests, padding.queries, padding.keys)
        step = self._graphs.get(key)
        if step is None or not set(capture_layers) <= set(step.layers):
            # every graph outputs every layer asked for so far: one graph a bucket, whatever the step's drafters
            self._layers = tuple(sorted(set(self._layers) | set(capture_layers)))
            step = self._capture(key, padding, self._layers)
        self._graphs.move_to_end(key)
        tokens, index, *rest = step.inputs
        tokens[:n].copy_(batch.tokens, non_blocking=True)
        tokens[n:].zero_()
        index[:m].copy_(batch.logit_index, non_blocking=True)
        index[m:].zero_()
        for held, new in zip(rest, _plan_tensors(plan), strict=True):
            held.copy_(new, non_blocking=True)
        if stats is not None:
            stats.graph_captures += self.captures - captures
        if step.graph is not None:
            step.graph.replay()
            self.replays += 1
        else:
            step.logits, step.features = self._compute(step)
        self.model.committed(prepared, self.cache, stats, t0)
        return step.logits[:m], {k: step.features[k][:n] for k in capture_layers}

    def warm_up(self, layers: tuple[int, ...] = ()) -> None:
        """Capture the buckets most steps meet — every power of two of requests up to
        `warm_requests`, `WARM_QUERIES` × `WARM_KEYS` — outputting `layers`. Run by the first
        graphed step (at start: the engine's cost-model profile or its check), so serving does
        not stall on captures (a first round on the H200 ran at a third of the second's speed
        while its buckets were captured)."""
        self._warm = True
        self._layers = tuple(sorted(set(self._layers) | set(layers)))
        requests = [1 << i for i in range(self.warm_requests.bit_length()) if 1 << i <= self.warm_requests]
        if requests[-1] < self.warm_requests:
            requests.append(_pow2(self.warm_requests))
        for r in requests:
            for q in WARM_QUERIES:
                for keys in WARM_KEYS:
                    if (r, q, keys) not in self._graphs:
                        self._capture((r, q, keys), Padding(r, q, keys, self.scratch), self._layers)

    def _compute(self, step: _Captured):
        tokens, index, *rest = step.inputs
        return self.model.compute(tokens, _plan_from(rest), self.cache, index, None, step.layers)

    def _capture(self, key: tuple, padding: Padding, layers: tuple[int, ...]) -> _Captured:
        """A bucket's fixed inputs, and on a GPU its graph: warmed up on a side stream, then
        captured into the rank's pool. The warm-up writes keys only at the scratch slot."""
        dev = self.cache.k.device
        zeros = [torch.zeros(padding.tokens, dtype=torch.long, device=dev) for _ in range(2)]  # tokens, logit index
        step = _Captured([*zeros, *_blank_plan(padding, self.model, dev)], layers)
        if self.capture:
            t0 = time.perf_counter()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._compute(step)
            torch.cuda.current_stream(dev).wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self._pool):
                step.logits, step.features = self._compute(step)
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
        self._graphs[key] = step
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return step

    def captured(self) -> list[torch.cuda.CUDAGraph]:
        """The graphs held, least recently replayed first."""
        return [step.graph for step in self._graphs.values() if step.graph is not None]

    def stats(self) -> dict:
        return {"mode": self.mode, "graphs": len(self._graphs), "captures": self.captures, "replays": self.replays,
                "capture_s": round(self.capture_s, 3)}


def _blank_plan(padding: Padding, model: MoETransformer, dev) -> list[torch.Tensor]:
    """A plan's tensors in `padding`'s shapes for a step of padding alone."""
    t, r, q = padding.tokens, padding.requests, padding.queries
    cos, sin = model.cfg.rotary.cos_sin(torch.zeros(t, dtype=torch.long))
    mask = torch.zeros(r, 1, q, padding.keys, dtype=torch.bool)
    mask[..., 0] = True
    return [torch.full((t,), padding.scratch, dtype=torch.long, device=dev), cos.to(dev), sin.to(dev),
            torch.zeros(r, padding.keys, dtype=torch.long, device=dev), mask.to(dev),
            torch.zeros(r, q, dtype=torch.long, device=dev), torch.zeros(t, dtype=torch.long, device=dev)]
