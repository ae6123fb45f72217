"""Profiling the deployed target's step cost, for the core cost model to fit.

For every (requests R, context c) of a grid, R requests are prefilled to c tokens once; then for
every tokens-per-request q a verification-shaped step (q tokens per request, logits at all of
them) is timed, and rolled back, `repeats` times; the median wall time is the sample. Wall time
is measured where the coordinator sees it, so Ray round trips count — they are part of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from actors.target.decode import prefill
from actors.target.moe import StepStats
from dcut_core.cost_model import CostModel, StepShape, fit
from dcut_core.hardware import ModelShape


@dataclass(frozen=True)
class ProfileGrid:
    requests: tuple[int, ...] = (1, 4, 16, 64)
    tokens_per_request: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (32, 128, 512)
    repeats: int = 3


QUICK_GRID = ProfileGrid((1, 4, 16), (1, 4, 8, 16), (32, 128), 2)


@dataclass
class ProfileSample:
    shape: StepShape
    seconds: float  # median wall time of the step
    stats: list[StepStats] = field(default_factory=list)  # per rank, from the median repeat

    def breakdown(self) -> dict[str, float]:
        """Mean over ranks of the time in each part of the step, plus bytes and experts."""
        n = max(1, len(self.stats))
        keys = ("attention_s", "experts_s", "dispatch_s", "combine_s", "other_s", "total_s")
        out = {k: sum(getattr(s, k) for s in self.stats) / n for k in keys}
        out["bytes_sent_max"] = max((s.bytes_sent for s in self.stats), default=0)
        out["distinct_experts_per_layer"] = (
            sum(s.distinct_experts for s in self.stats) / max(1, sum(s.moe_layers for s in self.stats)))
        return out


FIRST_RID = 1_000_000_000  # a profile's request ids start here, out of the way of real ones
CAPTURE_RETRIES = 2  # a timed forward that captured CUDA graphs (70–100 ms each; all the usual buckets in
# the first graphed one, actors/target/graphs.py) is run again, up to this many times


def run_profile(target, grid: ProfileGrid, vocab_size: int, seed: int = 0, progress=None) -> list[ProfileSample]:
    """Time verification steps over the grid on `target` (an `EPGroup` or `LocalTarget`)."""
    rng = np.random.default_rng(seed)
    samples: list[ProfileSample] = []
    next_id = FIRST_RID
    for r in grid.requests:
        for ctx in grid.contexts:
            ids = list(range(next_id, next_id + r))
            next_id += r
            prefill(target, ids, [rng.integers(0, vocab_size, ctx).tolist() for _ in ids], chunk_tokens=256)
            for q in grid.tokens_per_request:
                runs = []
                for _ in range(grid.repeats):
                    for _ in range(CAPTURE_RETRIES + 1):
                        chunks = [rng.integers(0, vocab_size, q).tolist() for _ in ids]
                        out = target.forward(ids, chunks, logits="all")
                        target.truncate(dict.fromkeys(ids, ctx))
                        if not any(s.graph_captures for s in out.rank_stats):
                            break  # a forward that captured a CUDA graph timed the capture: again
                    runs.append((out.wall_s, out.rank_stats))
                runs.sort(key=lambda x: x[0])
                wall, stats = runs[len(runs) // 2]
                samples.append(ProfileSample(StepShape(r, r * q, r * ctx), wall, stats))
                if progress is not None:
                    progress.update(1)
            target.release(ids)
    return samples


def fit_terms(ep: int) -> tuple[str, ...]:
    """Terms identifiable from one deployment's profile: at a single EP size the all-to-all
    latency is a constant, absorbed by `fixed`. `batching` (√tokens) is what lets one fit price a
    drafted token at one request and at 64: without it, the bundled model's CPU profile priced
    one at 1.7 × its measured cost at one request and 0.4–0.7 × at 8–32 (docs/benchmarks.md,
    session 37)."""
    base = ("fixed", "dense", "attention", "kv_read", "experts", "expert_flops", "batching")
    return (*base, "a2a_bytes") if ep > 1 else base


def fit_profile(samples: list[ProfileSample], shape: ModelShape, ep: int) -> CostModel:
    base = CostModel(shape, ep, {})
    return fit(base, [(s.shape, s.seconds) for s in samples], fit_terms(ep))


def holdout_error(samples: list[ProfileSample], shape: ModelShape, ep: int,
                  is_held_out) -> tuple[CostModel, float, int]:
    """Fit on the samples where is_held_out(shape) is false; median absolute percentage error on
    the others. Returns (model, MdAPE, number held out)."""
    train = [s for s in samples if not is_held_out(s.shape)]
    test = [s for s in samples if is_held_out(s.shape)]
    model = fit_profile(train, shape, ep)
    errors = [abs(model.predict(s.shape) - s.seconds) / s.seconds for s in test]
    return model, float(np.median(errors)) if errors else float("nan"), len(test)
