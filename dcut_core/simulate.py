"""Discrete-event simulation of the coordinator loop: what-if runs without weights.

Closed loop at a fixed concurrency B: B requests are always running; each step every request
drafts a block, a policy keeps some drafts, one verification step costs what the cost source
says, each request commits min(a, kept) + 1 tokens, and a request that has produced its
`output_len` tokens is replaced by a fresh one (new quality). Time advances by the step's cost
(plus the drafting cost, if any). The same seed gives every policy the same requests and the same
drafts, so policies are compared on identical inputs, as `dcut bench` does on the engine.

The policies see survivals as the engine builds them: `dcut` calibrates the drafter's confidences
online from verification outcomes (`acceptance.Calibrator`, censoring included) and plans drafting
with the gate of `drafting.py` when drafting has a cost; the other policies use raw confidences
(the D-Cut paper's survival is the product of raw confidences). AR decoding costs `ar_seconds(B)`,
a separate input: serving stacks run plain decoding on a different, faster path (captured graphs,
no block attention) than verification, so it is not the verify curve at one token per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dcut_core import ragged
from dcut_core.acceptance import Calibrator, survival, verify_outcomes
from dcut_core.drafting import AcceptanceTracker, DraftCost, DraftingCosts, Survival
from dcut_core.planning import DraftPlanner
from dcut_core.pruning import DraftBatch, Policy, StepCost
from dcut_core.traces import RecordedTrace, SyntheticTrace

# Batch size -> verification cost as a function of total verify tokens.
VerifyCost = Callable[[int], StepCost]


@dataclass(frozen=True)
class TableCost:
    """Verification step time from a measured table (rows: batch sizes; columns: verify tokens
    per request). Linear in tokens between and beyond columns and linear in the batch size
    between rows (step time is close to linear in total tokens); never below `floor_ms`."""

    batches: tuple[int, ...]
    per_request: tuple[float, ...]
    ms: tuple[tuple[float, ...], ...]
    floor_ms: float = 1.0

    def _row(self, i: int, per_req: np.ndarray) -> np.ndarray:
        x, y = np.asarray(self.per_request, dtype=np.float64), np.asarray(self.ms[i], dtype=np.float64)
        inside = np.interp(per_req, x, y)
        below = y[0] + (per_req - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
        above = y[-1] + (per_req - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        return np.where(per_req < x[0], below, np.where(per_req > x[-1], above, inside))

    def seconds(self, batch: int, tokens: np.ndarray) -> np.ndarray:
        per_req = np.asarray(tokens, dtype=np.float64) / batch
        rows = np.asarray(self.batches, dtype=np.float64)
        j = int(np.clip(np.searchsorted(rows, batch) - 1, 0, len(rows) - 2))
        t = (batch - rows[j]) / (rows[j + 1] - rows[j])  # < 0 or > 1 extrapolates
        ms = (1 - t) * self._row(j, per_req) + t * self._row(j + 1, per_req)
        return np.maximum(ms, self.floor_ms) * 1e-3

    def curve(self, batch: int) -> StepCost:
        return StepCost(lambda tokens: self.seconds(batch, tokens))


@dataclass(frozen=True)
class LinearAr:
    """Plain decoding step time a + b·B (seconds)."""

    a: float
    b: float

    def __call__(self, batch: int) -> float:
        return self.a + self.b * batch


def fit_ar(batches: Sequence[int], seconds: Sequence[float]) -> LinearAr:
    """a + b·B through implied AR step times, least squares in relative error, both ≥ 0."""
    x, y = np.asarray(batches, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    b, a = np.polyfit(x, y, 1, w=1.0 / y)
    if b < 0:
        return LinearAr(float(y.mean()), 0.0)
    if a < 0:
        return LinearAr(0.0, float((x @ y) / (x @ x)))
    return LinearAr(float(a), float(b))


@dataclass(frozen=True)
class SimConfig:
    batch: int  # concurrency B
    block: int  # drafter block: block − 1 drafts per request per step
    steps: int | None = None  # default: enough for ≈ 40 000 request-steps (small B needs many)
    output_len: int = 256  # tokens a request produces before a fresh one replaces it
    draft_cost: DraftCost = DraftCost()  # noqa: RUF009 - frozen, shared safely
    draft_slack: int = 2  # as the engine's EngineConfig.draft_slack
    draft_extend: bool = True  # as the engine's EngineConfig.draft_extend
    seed: int = 0

    @property
    def num_steps(self) -> int:
        return self.steps if self.steps is not None else max(400, 40_000 // self.batch)


@dataclass(frozen=True)
class SimResult:
    policy: str
    batch: int
    block: int
    tokens: int
    seconds: float
    steps: int
    kept: int
    drafted: int
    ar_seconds: float  # plain decoding step time at this batch

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def speedup(self) -> float:
        return self.tok_s / (self.batch / self.ar_seconds)

    @property
    def mat(self) -> float:
        return self.tokens / (self.steps * self.batch)

    @property
    def keep_ratio(self) -> float:
        return self.kept / self.drafted if self.drafted else 0.0

    def record(self) -> dict:
        return {"policy": self.policy, "batch": self.batch, "block": self.block, "speedup": self.speedup,
                "tok_s": self.tok_s, "mat": self.mat, "keep_ratio": self.keep_ratio,
                "verify_tokens_per_step": (self.batch * self.steps + self.kept) / self.steps}


def simulate(policy: Policy, cfg: SimConfig, trace: SyntheticTrace | RecordedTrace, verify: VerifyCost,
             ar_seconds: Callable[[int], float], calibrated: bool | None = None) -> SimResult:
    """One closed-loop run of `policy`; `calibrated` defaults to True for `dcut` only."""
    # Two streams: the n-th request has the same quality under every policy, and draft draws do
    # not shift when a faster policy finishes requests earlier.
    rng, request_rng = np.random.default_rng([cfg.seed, 0]), np.random.default_rng([cfg.seed, 1])
    drafts = cfg.block - 1
    calibrated = policy.name == "dcut" if calibrated is None else calibrated
    gated = policy.name == "dcut" and (cfg.draft_cost.fixed + cfg.draft_cost.per_position) > 0
    cal, tracker = Calibrator(block=cfg.block), AcceptanceTracker(block=drafts)
    planner = DraftPlanner(slack=cfg.draft_slack, extend=cfg.draft_extend)
    quality = trace.new_requests(request_rng, cfg.batch)
    left = np.full(cfg.batch, cfg.output_len)
    rid = np.arange(cfg.batch)
    next_rid = cfg.batch
    cost = verify(cfg.batch)
    tokens = kept_total = drafted_total = 0
    seconds = 0.0
    for _ in range(cfg.num_steps):
        draw = trace.draw(rng, quality, drafts)  # drawn for every policy: same stream of drafts
        lengths = np.full(cfg.batch, drafts)
        if gated:
            predicted = Survival.of([tracker.predict(int(r), drafts) for r in rid])
            lengths = planner.plan(predicted, cost, DraftingCosts([cfg.draft_cost])).lengths
            tracker.skipped([int(rid[i]) for i in np.nonzero(lengths == 0)[0]])
        # [N] flat drafts of this step, ragged by cu
        cu = np.concatenate([[0], np.cumsum(lengths)])
        pos = ragged.positions(cu)
        conf = draw.confidence[np.repeat(np.arange(cfg.batch), lengths), pos]
        p = cal.estimate(conf, np.zeros_like(conf), pos) if calibrated else conf
        truth = np.minimum(draw.accepted, lengths)
        decision = policy.choose(DraftBatch(survival(p, cu), cu, truth), cost)
        kept = decision.kept
        accepted = np.minimum(truth, kept)
        step_s = float(cost.seconds(np.array([cfg.batch + int(kept.sum())]))[0])
        step_s += float(cfg.draft_cost.seconds(int((lengths > 0).sum()), int(lengths.sum())))
        if calibrated:
            idx, ok = verify_outcomes(cu, kept, accepted)
            cal.observe(conf[idx], np.zeros(len(idx)), pos[idx], ok)
        if gated:
            for i in range(cfg.batch):
                tracker.observe(int(rid[i]), int(kept[i]), int(accepted[i]))
        made = np.minimum(accepted + 1, left)
        tokens += int(made.sum())
        kept_total += int(kept.sum())
        drafted_total += int(lengths.sum())
        seconds += step_s
        left -= made
        done = np.nonzero(left <= 0)[0]
        if len(done):
            quality[done] = trace.new_requests(request_rng, len(done))
            left[done] = cfg.output_len
            for i in done:
                tracker.forget(int(rid[i]))
                rid[i] = next_rid
                next_rid += 1
    return SimResult(policy.name, cfg.batch, cfg.block, tokens, seconds, cfg.num_steps, kept_total, drafted_total,
                     ar_seconds(cfg.batch))
