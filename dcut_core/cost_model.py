"""Step-latency model: a sum of named, non-negative terms over features of the step's shape.

    seconds = Σ_t coef[t] · feature_t(step)

Terms (all features are non-decreasing in the step's token count, so with non-negative
coefficients the model is monotone, which pruning's budget scan assumes):

    fixed         1                                     launches, dense weight reads
    dense         tokens                                per-token matmuls every token pays
    attention     Σ tokens · context                    score and value work of the new tokens
    kv_read       Σ context over requests               reading each request's KV cache once
    experts       MoE layers · distinct experts on the busiest rank
                                                        expert weight reads (memory-bound side)
    expert_flops  MoE layers · token-expert pairs per rank
                                                        expert matmuls (compute-bound side)
    a2a_latency   MoE layers · [EP > 1]                 dispatch + combine fixed latency
    a2a_bytes     MoE layers · bytes the busiest rank sends (dispatch + combine)
    batching      √tokens                               products over more tokens run nearer the
                                                        machine's peak: the marginal token costs
                                                        less in a bigger step (fitted, never preset)

Distinct experts for n tokens routed top-k over E experts uniformly: E·(1 − (1 − k/E)^n);
a rank that holds E/EP of them sees that count divided by EP.
Runtimes that pad to fixed shapes (CUDA graphs) make cost a step function of tokens: `pad_tokens`
rounds the token count up to the next captured size before the features are taken.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from dcut_core.hardware import HARDWARE, MODELS, Hardware, ModelShape
from dcut_core.nnls import nnls
from dcut_core.pruning import StepCost

# Below this exponent expm1 is −1.0 exactly (e^x < 2⁻⁵⁴ from x < −37.5): the experts term has
# saturated, and a curve adds it as a constant rather than exponentiating thousands of counts.
SATURATED = -40.0
TERMS = ("fixed", "dense", "attention", "kv_read", "experts", "expert_flops", "a2a_latency", "a2a_bytes", "batching")


@dataclass(frozen=True)
class StepShape:
    """What a verification (or decode) step looks like to the cost model."""

    requests: int
    tokens: int  # verify tokens in the step: R + kept drafts
    context: int  # Σ over requests of their cached context length


def expected_distinct_experts(tokens: np.ndarray | int, experts: int, top_k: int) -> np.ndarray:
    """Expected number of distinct experts n tokens touch, uniform top-k routing: [same as tokens]."""
    n = np.asarray(tokens, dtype=np.float64)
    if experts <= 0:
        return np.zeros_like(n)
    return experts * (1.0 - (1.0 - top_k / experts) ** n)


@dataclass(frozen=True)
class CostModel:
    """A fitted or preset step-time model for one deployment (model shape × EP size)."""

    model: ModelShape
    ep: int
    coef: dict[str, float]
    pad_tokens: tuple[int, ...] = ()
    source: str = "preset"
    # The last `_closed_form` asked, ((requests, context), parts): a step asks for its own shape
    # up to six times (the curve, the prediction it records, what the correction learns).
    _last: list = field(default_factory=lambda: [None], init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.coef) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown cost terms: {sorted(unknown)}")
        if any(v < 0 or not math.isfinite(v) for v in self.coef.values()):
            raise ValueError("cost coefficients must be finite and non-negative")
        if self.ep < 1 or (self.model.is_moe and self.model.experts % self.ep):
            raise ValueError(f"EP size {self.ep} must divide the expert count {self.model.experts}")

    # -- features ---------------------------------------------------------------------------

    def padded(self, tokens: np.ndarray) -> np.ndarray:
        if not self.pad_tokens:
            return tokens
        sizes = np.asarray(self.pad_tokens, dtype=np.int64)
        idx = np.minimum(np.searchsorted(sizes, tokens), len(sizes) - 1)
        return np.where(tokens <= sizes[-1], sizes[idx], tokens)

    def features(self, requests: np.ndarray, tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Feature matrix [S, len(TERMS)] for S step shapes given as arrays."""
        m = self.model
        tok = self.padded(np.asarray(tokens, dtype=np.int64)).astype(np.float64)
        req = np.maximum(np.asarray(requests, dtype=np.float64), 1.0)
        ctx = np.asarray(context, dtype=np.float64)
        moe = float(m.moe_layers) if m.is_moe else 0.0
        ep_on = 1.0 if self.ep > 1 else 0.0
        per_rank_tokens = np.ceil(tok / self.ep)
        sent = per_rank_tokens * m.top_k * (self.ep - 1) / self.ep * m.hidden * m.act_bytes
        cols = {
            "fixed": np.ones_like(tok),
            "dense": tok,
            "attention": tok * ctx / req,
            "kv_read": ctx,
            "experts": moe * expected_distinct_experts(tok, m.experts, m.top_k) / self.ep,
            "expert_flops": moe * tok * m.top_k / self.ep,
            "a2a_latency": moe * ep_on * np.ones_like(tok),
            "a2a_bytes": moe * 2.0 * sent,
            "batching": np.sqrt(tok),
        }
        return np.stack([cols[t] for t in TERMS], axis=-1)

    def coef_vector(self) -> np.ndarray:
        return np.array([self.coef.get(t, 0.0) for t in TERMS])

    # -- prediction -------------------------------------------------------------------------

    def predict(self, shape: StepShape) -> float:
        """Seconds of one step: the closed form of `verify_curve` in plain floats (it equals
        `features @ coef`, tested; the engine predicts every step, and numpy's per-call cost on
        one-element arrays was 0.1 ms of it)."""
        a, b, per_rank, d, log_miss, g = self._closed_form(shape.requests, shape.context)
        n = shape.tokens
        if self.pad_tokens:
            i = min(bisect.bisect_left(self.pad_tokens, n), len(self.pad_tokens) - 1)
            n = self.pad_tokens[i] if n <= self.pad_tokens[-1] else n
        out = a + b * n
        if per_rank:
            out += per_rank * math.ceil(n / self.ep)
        if d and n:
            out += d * -math.expm1(n * log_miss)
        if g:
            out += g * math.sqrt(n)
        return float(out)

    def base_and_extra(self, shape: StepShape) -> tuple[float, float]:
        """(b, e): seconds of the step without its extra tokens (its requests' one token each), and
        what those tokens add."""
        base = self.predict(StepShape(shape.requests, min(shape.tokens, shape.requests), shape.context))
        return base, max(0.0, self.predict(shape) - base)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """Seconds per term for one step."""
        f = self.features(np.array([shape.requests]), np.array([shape.tokens]), np.array([shape.context]))[0]
        return {t: float(f[i] * self.coef.get(t, 0.0)) for i, t in enumerate(TERMS)}

    def verify_curve(self, requests: int, context: int) -> StepCost:
        """Step cost as a function of total verify tokens, for one batch (pruning's input).

        The features collapse, for fixed requests and context, to
        a + b·n + c·ceil(n / EP) + d·(1 − (1 − k/E)^n) + g·√n with n the padded token count;
        this closed form is what the scan evaluates at every budget (it equals `features @ coef`).
        """
        a, b, per_rank, d, log_miss, g = self._closed_form(requests, context)
        ep = self.ep

        def curve(tokens: np.ndarray) -> np.ndarray:
            n = self.padded(np.asarray(tokens, dtype=np.int64)).astype(np.float64)
            out = n * b  # in place from here: the scan asks thousands of counts (the same bits as a + b·n + …)
            out += a
            if per_rank:
                t = n / ep
                np.ceil(t, out=t)
                t *= per_rank
                out += t
            if d and n.size and float(n.min()) * log_miss < SATURATED:  # every count touches every expert
                out += d  # −expm1 is 1.0 to the last bit there: d·1.0, what the line below adds
            elif d:
                t = n * log_miss
                np.expm1(t, out=t)
                t *= -d
                out += t
            if g:
                t = np.sqrt(n)
                t *= g
                out += t
            return out

        # Every term but b·n is non-decreasing in n, so b bounds the marginal cost from below
        # (padding makes plateaus: then no bound).
        return StepCost(curve, 0.0, 0.0 if self.pad_tokens else b)

    def _closed_form(self, requests: int, context: int) -> tuple[float, float, float, float, float, float]:
        """(a, b, per_rank, d, log_miss, g): the step's seconds at n tokens are
        a + b·n + per_rank·ceil(n / EP) + d·(1 − exp(n · log_miss)) + g·√n."""
        last = self._last[0]  # one read: another thread may replace it
        if last is not None and last[0] == (requests, context):
            return last[1]
        parts = self._parts_at(requests, context)
        self._last[0] = ((requests, context), parts)
        return parts

    def _parts_at(self, requests: int, context: int) -> tuple[float, float, float, float, float, float]:
        m, c, ep = self.model, self.coef, self.ep
        moe = float(m.moe_layers) if m.is_moe else 0.0
        req = max(requests, 1)
        a = c.get("fixed", 0.0) + c.get("kv_read", 0.0) * context
        a += c.get("a2a_latency", 0.0) * moe * (1.0 if ep > 1 else 0.0)
        b = c.get("dense", 0.0) + c.get("attention", 0.0) * context / req
        b += c.get("expert_flops", 0.0) * moe * m.top_k / ep
        per_rank = c.get("a2a_bytes", 0.0) * moe * 2.0 * m.top_k * (ep - 1) / ep * m.hidden * m.act_bytes
        d = c.get("experts", 0.0) * moe * m.experts / ep if m.is_moe else 0.0
        log_miss = math.log1p(-m.top_k / m.experts) if m.is_moe and m.top_k < m.experts else -math.inf
        return a, b, per_rank, d, log_miss, c.get("batching", 0.0)

    # -- persistence ------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {"version": 1, "model": asdict(self.model), "ep": self.ep, "coef": self.coef,
             "pad_tokens": list(self.pad_tokens), "source": self.source},
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        d = json.loads(text)
        if d.get("version") != 1:
            raise ValueError(f"unsupported cost model version {d.get('version')!r}")
        return cls(ModelShape(**d["model"]), int(d["ep"]), {k: float(v) for k, v in d["coef"].items()},
                   tuple(int(x) for x in d.get("pad_tokens", ())), d.get("source", "file"))


def preset(model: ModelShape | str, hardware: Hardware | str, ep: int = 1,
           pad_tokens: Sequence[int] = ()) -> CostModel:
    """Cost model from first principles: roofline figures of the hardware, shapes of the model."""
    m = MODELS[model] if isinstance(model, str) else model
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    flops, bw = hw.peak_flops, hw.mem_bw
    coef = {
        # Attention and dense weights are replicated (data-parallel attention): every rank reads
        # them once per step and handles 1/EP of the tokens and KV caches.
        "fixed": hw.launch_s + m.dense_params * m.param_bytes / bw,
        "dense": 2.0 * m.dense_params / flops / ep,
        "attention": m.layers * m.attention_flops_per_key / flops / ep,
        "kv_read": m.layers * m.kv_per_token * m.act_bytes / bw / ep,
        "experts": m.expert_params * m.param_bytes / bw if m.is_moe else 0.0,
        "expert_flops": 2.0 * m.expert_params / flops if m.is_moe else 0.0,
        "a2a_latency": hw.a2a_latency_s(ep) if m.is_moe else 0.0,
        "a2a_bytes": 1.0 / hw.a2a_bw(ep) if m.is_moe and ep > 1 else 0.0,
        "batching": 0.0,  # a roofline has no such curve: only a fit to measured steps finds it
    }
    return CostModel(m, ep, coef, tuple(pad_tokens), f"preset:{hw.name}")


def fit(base: CostModel, samples: Sequence[tuple[StepShape, float]],
        terms: Sequence[str] = TERMS) -> CostModel:
    """Fit non-negative coefficients of `terms` to measured (shape, seconds) samples.

    Each sample is weighted by 1/seconds so that relative error counts, not absolute: a 10 %
    miss on a 4 ms step matters as much as on a 100 ms one.
    """
    if len(samples) < len(terms):
        raise ValueError(f"need at least {len(terms)} samples to fit {len(terms)} terms")
    req = np.array([s.requests for s, _ in samples])
    tok = np.array([s.tokens for s, _ in samples])
    ctx = np.array([s.context for s, _ in samples])
    y = np.array([t for _, t in samples], dtype=np.float64)
    if (y <= 0).any() or not np.isfinite(y).all():
        raise ValueError("measured step times must be positive and finite")
    cols = [TERMS.index(t) for t in terms]
    x = base.features(req, tok, ctx)[:, cols]
    # Scale columns to unit norm so the active-set solver sees a well-conditioned problem.
    w = 1.0 / y
    xa = x * w[:, None]
    norms = np.linalg.norm(xa, axis=0)
    norms[norms == 0] = 1.0
    c = nnls(xa / norms, y * w) / norms
    return replace(base, coef={t: float(c[i]) for i, t in enumerate(terms)}, source="fitted")


@dataclass
class OnlineCorrection:
    """Refines a cost model from measured step times while serving.

    Two corrections. The level: an exponentially weighted mean of log(measured / predicted)
    (`scale`). And the split of a step's time between the step it would be without drafts (its
    requests' one token each, b) and what its extra tokens add (e = predicted − b): measured ≈
    s_b·b + s_e·e, fitted by exponentially weighted least squares on relative errors, pulled
    towards the level where the steps cannot tell the two apart (only plain steps, or every step
    drafting alike). A profile whose shape is off — a slope measured on a busy machine — would
    otherwise be corrected in level only: plain steps over-predicted, drafting steps
    under-predicted, and drafting looked cheaper than it was (on the bundled model at one request
    a fresh profile's plain steps took 0.90 × their prediction and steps verifying 5+ drafts 1.09 ×,
    docs/benchmarks.md, session 26). Keeps the most recent samples so `refit` can re-run the full
    fit on live data. All of it is a few float operations a step.
    """

    model: CostModel
    halflife_steps: float = 50.0
    keep: int = 2048
    log_ratio: float = 0.0
    observed: int = 0
    samples: list[tuple[StepShape, float]] = field(default_factory=list)
    split_halflife_steps: float = 200.0  # the split's memory: drafting steps can be few among plain ones
    ridge: float = 0.05  # the pull towards the level, in steps' worth: it decides only what the steps leave open
    # The split's weighted normal equations over (b/m, e/m): [Σbb, Σbe, Σee, Σb, Σe].
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)
    _split: tuple[float, float] | None = field(default=None, repr=False)  # (s_b, s_e), None: the level's
    # (model, shape, parts) of the last `_parts`: a step's shape is priced where it is committed
    # and again where it is learnt.
    _last_parts: tuple | None = field(default=None, repr=False, compare=False)

    def observe(self, shape: StepShape, seconds: float) -> float:
        """Learn from one measured step; returns the prediction for it made before learning
        (what `predict(shape)` said), so a caller that records both predicts once."""
        b, e = self._parts(shape)
        predicted = b + e
        before = self._scaled(b, e)
        if predicted <= 0 or seconds <= 0:
            return before
        # A running mean over the first observations, then the half-life: a start-up profile
        # that is off (other processes share the cores) is corrected from the first step on.
        alpha = max(1.0 - 0.5 ** (1.0 / self.halflife_steps), 1.0 / (self.observed + 1))
        self.log_ratio += alpha * (math.log(seconds / predicted) - self.log_ratio)
        self.observed += 1
        self._learn_split(b / seconds, e / seconds)
        self.samples.append((shape, seconds))
        if len(self.samples) > self.keep:
            del self.samples[: len(self.samples) - self.keep]
        return before

    def _learn_split(self, xb: float, xe: float) -> None:
        """One step's relative parts (b/m, e/m; the target is 1) into the split's sums, older
        steps forgotten at `split_halflife_steps`; then (s_b, s_e) solved anew."""
        g = 0.5 ** (1.0 / self.split_halflife_steps)
        sums = self._sums
        for i, v in enumerate((xb * xb, xb * xe, xe * xe, xb, xe)):
            sums[i] = g * sums[i] + v
        bb, be, ee, yb, ye = sums
        s, lam = self.scale, self.ridge
        a11, a12, a22 = bb + lam, be, ee + lam
        det = a11 * a22 - a12 * a12
        sb = ((yb + lam * s) * a22 - a12 * (ye + lam * s)) / det
        se = (a11 * (ye + lam * s) - a12 * (yb + lam * s)) / det
        self._split = (min(max(sb, s / 8), 8 * s), min(max(se, s / 8), 8 * s))

    def _parts(self, shape: StepShape) -> tuple[float, float]:
        """(b, e): the model's seconds for the step without its extra tokens, and what they add."""
        last, model = self._last_parts, self.model  # one read each: the learner thread may replace them
        if last is not None and last[0] is model and last[1] == shape:
            return last[2]
        parts = model.base_and_extra(shape)
        self._last_parts = (model, shape, parts)
        return parts

    def _scaled(self, b: float, e: float) -> float:
        if self._split is None:
            return self.scale * (b + e)
        sb, se = self._split
        return sb * b + se * e

    @property
    def scale(self) -> float:
        return math.exp(self.log_ratio)

    @property
    def split(self) -> tuple[float, float]:
        """(s_b, s_e): the corrections of a step's base and of its extra tokens."""
        return self._split or (self.scale, self.scale)

    def predict(self, shape: StepShape) -> float:
        return self._scaled(*self._parts(shape))

    def verify_curve(self, requests: int, context: int) -> StepCost:
        """The model's curve for the batch, its base (at `requests` tokens) and what each token
        adds to it corrected apart."""
        base = self.model.verify_curve(requests, context)
        sb, se = self.split
        # s_b·b + s_e·(curve − b) = s_e·curve + (s_b − s_e)·b, b in floats as `_parts` has it
        lift = (sb - se) * self.model.predict(StepShape(requests, requests, context)) if requests else 0.0
        return StepCost(lambda tokens: se * base.verify_seconds(tokens) + lift, 0.0, se * base.min_marginal)

    def refit(self, terms: Sequence[str] = TERMS) -> None:
        """Replace the model by a fit on the kept samples and reset the correction."""
        self.model = fit(self.model, self.samples, terms)
        self.log_ratio = 0.0
        self._sums, self._split = [0.0] * 5, None
