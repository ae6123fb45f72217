"""Counterfactual traces: what every drafter kind would have proposed at every position of a
known greedy output, and what the target would have accepted of it.

Greedy decoding is lossless whatever drafts, so a request's output is known before any policy
runs. At output position t (t tokens committed: the prompt's first token came from prefill, so
t ≥ 1) drafter kind k, given the context prompt + output[:t], proposes up to L drafts with their
confidences; the target accepts the longest prefix equal to output[t:]. A policy that keeps n
of them gets min(n, accepted) accepted plus one bonus token. Recorded once (`dcut trace`), any
gate, chooser or pruning policy replays over it exactly (`dcut_core.trace_sim`), with the unit's
measured costs (`TraceCosts`).

Plain data in and out (numpy): `as_dict` / `from_dict` give msgpack-ready values (raw buffers
for arrays, so the same trace packs to the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dcut_core.cost_model import CostModel, StepShape
from dcut_core.drafting import DraftCost

VERSION = 1


def _pack(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _unpack(d: dict) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


@dataclass(frozen=True)
class KindRows:
    """One kind's rows of one request (`RequestTrace`'s arrays at that kind): drafts proposed
    [T], accepted [T], and each draft's confidence, margin and token [T, L]."""

    count: np.ndarray
    accepted: np.ndarray
    confidence: np.ndarray
    margin: np.ndarray
    tokens: np.ndarray

    def as_dict(self) -> dict:
        return {k: _pack(getattr(self, k)) for k in ROWS}

    @classmethod
    def from_dict(cls, d: dict) -> KindRows:
        return cls(*(_unpack(d[k]) for k in ROWS))


@dataclass(frozen=True)
class RequestTrace:
    """One request: its prompt's length, its greedy output [T], and per drafter kind and
    position the drafts it would get. Row t of each [K, T, ...] array is drafting after t output
    tokens (row 0 is never drafted: prefill makes the first token)."""

    prompt_len: int
    output: np.ndarray  # [T] int64
    count: np.ndarray  # [K, T] int64 drafts proposed (≤ L; an n-gram drafter may propose fewer or none)
    accepted: np.ndarray  # [K, T] int64 leading drafts equal to output[t:] (≤ count)
    confidence: np.ndarray  # [K, T, L] float32 the drafter's probability of each draft (0 past count)
    margin: np.ndarray  # [K, T, L] float32 top-1 minus top-2 probability
    tokens: np.ndarray  # [K, T, L] int64 the drafts (-1 past count)
    # [T] float32 the target's own probability of output[t − 1] where it emitted it (its softmax's
    # top one at that row): known before drafting at position t, a signal no drafter pays for
    # (row 0: 0). None in traces recorded before it was.
    target_confidence: np.ndarray | None = None
    # The rows of the kind that drafts from earlier requests' outputs (`Trace.corpus_kind`, the
    # n-gram kind) where its corpus held only the outputs of the requests `lag` or more places
    # before this one, by lag: what a closed loop at concurrency `lag` gives it, roughly (requests
    # start in order and, of equal lengths, end in order). The kind's own rows are lag 1, every
    # earlier request's output in. None: not recorded.
    corpus: dict[int, KindRows] | None = None

    @property
    def length(self) -> int:
        return len(self.output)

    def as_dict(self) -> dict:
        extra = {} if self.target_confidence is None else {"target_confidence": _pack(self.target_confidence)}
        if self.corpus is not None:
            extra["corpus"] = {str(lag): rows.as_dict() for lag, rows in sorted(self.corpus.items())}
        return {"prompt_len": self.prompt_len, **{k: _pack(getattr(self, k)) for k in ARRAYS}, **extra}

    @classmethod
    def from_dict(cls, d: dict) -> RequestTrace:
        conf, corpus = d.get("target_confidence"), d.get("corpus")
        return cls(int(d["prompt_len"]), **{k: _unpack(d[k]) for k in ARRAYS},
                   target_confidence=None if conf is None else _unpack(conf),
                   corpus=None if corpus is None else {int(lag): KindRows.from_dict(r) for lag, r in corpus.items()})

    def with_rows(self, k: int, rows: KindRows) -> RequestTrace:
        """This request with kind k's rows replaced by `rows`."""
        arrays = {}
        for name in ROWS:
            a = getattr(self, name).copy()
            a[k] = getattr(rows, name)
            arrays[name] = a
        return replace(self, **arrays)


ROWS = ("count", "accepted", "confidence", "margin", "tokens")  # a kind's rows of a request (`KindRows`)
ARRAYS = ("output", *ROWS)


@dataclass(frozen=True)
class TraceCosts:
    """The unit's measured costs: the verify forward (cost model and its online correction),
    each kind's drafting pass, what any drafting call adds, and the step's own time outside the
    passes (a plain step's, and what a drafting step adds to it)."""

    verify: CostModel
    verify_scale: float
    draft: tuple[DraftCost, ...]  # per kind
    shared: float = 0.0  # seconds any drafting call costs beyond its kinds' passes
    # A step's own time outside the forward and the drafters' passes, a + b·R for R requests:
    own: tuple[float, float] = (0.0, 0.0)  # plain decoding (`ar`)
    own_policy: tuple[float, float] = (0.0, 0.0)  # what a drafting policy's step that drafts nothing adds (the gate)
    own_drafting: tuple[float, float] = (0.0, 0.0)  # what a drafting step adds to one that drafts nothing
    # The same two for an engine hosting one kind, measured beside a unit of several (its gate
    # chooses no kind, and it keeps one kind's trackers): None when not measured (a one-kind trace).
    own_one: tuple[tuple[float, float], tuple[float, float]] | None = None
    # A run of the kind chooser, a + b·R seconds, measured apart and left out of `own_policy` and
    # `own_drafting`: charged where it runs, so a replay weighs how often it does (`stick`). None:
    # not measured apart (a one-kind trace, or one recorded before; its lines hold the chooser's share).
    choose: tuple[float, float] | None = None

    def for_kinds(self, hosted: int) -> TraceCosts:
        """The costs an engine hosting `hosted` kinds pays: its own time per step is the
        one-kind engine's when it hosts one and the trace measured that; one kind runs no chooser."""
        if hosted != 1:
            return self
        if self.own_one is None:
            return replace(self, choose=None)
        return replace(self, own_policy=self.own_one[0], own_drafting=self.own_one[1], own_one=None, choose=None)

    def choose_seconds(self, requests: int) -> float:
        """A run of the kind chooser for `requests` requests (0 where not measured apart)."""
        if self.choose is None:
            return 0.0
        return max(0.0, self.choose[0] + self.choose[1] * requests)

    def forward_seconds(self, shape: StepShape) -> float:
        return self.verify_scale * self.verify.predict(shape)

    def own_seconds(self, requests: int, policy_drafts: bool, drafting: bool) -> float:
        parts = [self.own] + ([self.own_policy] if policy_drafts else []) + ([self.own_drafting] if drafting else [])
        return max(0.0, sum(a + b * requests for a, b in parts))

    def verify_curve(self, requests: int, context: int):
        base = self.verify.verify_curve(requests, context)
        s = self.verify_scale
        from dcut_core.pruning import StepCost

        return StepCost(lambda tokens: s * base.verify_seconds(tokens), 0.0, s * base.min_marginal)

    def as_dict(self) -> dict:
        return {"verify": self.verify.to_json(), "verify_scale": self.verify_scale,
                "draft": [[d.fixed, d.per_request, d.per_position, d.per_context, d.per_pass] for d in self.draft],
                "shared": self.shared, "own": list(self.own), "own_policy": list(self.own_policy),
                "own_drafting": list(self.own_drafting)} | (
                    {} if self.own_one is None else {"own_one": [list(x) for x in self.own_one]}) | (
                    {} if self.choose is None else {"choose": list(self.choose)})

    @classmethod
    def from_dict(cls, d: dict) -> TraceCosts:
        one, choose = d.get("own_one"), d.get("choose")  # absent in traces recorded before they were measured
        return cls(CostModel.from_json(d["verify"]), float(d["verify_scale"]),
                   tuple(DraftCost(*map(float, x)) for x in d["draft"]), float(d["shared"]),
                   *(tuple(map(float, d[k])) for k in ("own", "own_policy", "own_drafting")),
                   None if one is None else (tuple(map(float, one[0])), tuple(map(float, one[1]))),
                   None if choose is None else (float(choose[0]), float(choose[1])))


@dataclass(frozen=True)
class Trace:
    """Requests of one workload under one unit: kinds name the [K] axis of every request's
    arrays; block − 1 = L drafts at most per position; max_tokens each request's limit."""

    kinds: tuple[str, ...]
    block: int
    max_tokens: int
    requests: tuple[RequestTrace, ...]
    costs: TraceCosts
    meta: dict = field(default_factory=dict)  # provenance: model, prompts file, when (informative)
    corpus_kind: str | None = None  # the kind with rows by corpus lag (`RequestTrace.corpus`), if recorded

    def __post_init__(self) -> None:
        k, width = len(self.kinds), self.block - 1
        for r in self.requests:
            t = r.length
            if r.count.shape != (k, t) or r.accepted.shape != (k, t) or r.confidence.shape != (k, t, width):
                raise ValueError(f"request arrays do not match {k} kinds × {t} positions × {width} drafts")
            _check_counts(r.count, r.accepted, width)
            if r.target_confidence is not None and r.target_confidence.shape != (t,):
                raise ValueError(f"target confidence of shape {r.target_confidence.shape} for {t} positions")
            if (r.corpus is not None) != (self.corpus_kind is not None):
                raise ValueError("rows by corpus lag need the kind they belong to, and every request its own")
            for lag, rows in (r.corpus or {}).items():
                if lag < 2 or rows.count.shape != (t,) or rows.accepted.shape != (t,) or \
                        rows.confidence.shape != (t, width) or rows.margin.shape != (t, width) or \
                        rows.tokens.shape != (t, width):
                    raise ValueError(f"rows at corpus lag {lag} do not match {t} positions × {width} drafts")
                _check_counts(rows.count, rows.accepted, width)
        if self.corpus_kind is not None:
            self.kind_index((self.corpus_kind,))
            if len({frozenset(r.corpus) for r in self.requests}) > 1:
                raise ValueError("every request needs its rows at the same corpus lags")
        if len(self.costs.draft) != k:
            raise ValueError(f"{len(self.costs.draft)} drafting costs for {k} kinds")

    def kind_index(self, names: tuple[str, ...]) -> list[int]:
        unknown = set(names) - set(self.kinds)
        if unknown:
            raise ValueError(f"the trace has no {', '.join(sorted(unknown))} (it has {', '.join(self.kinds)})")
        return [self.kinds.index(n) for n in names]

    @property
    def output_tokens(self) -> int:
        return sum(r.length for r in self.requests)

    @property
    def corpus_lags(self) -> tuple[int, ...]:
        """The corpus lags recorded beyond the kind's own rows (lag 1), ascending."""
        return tuple(sorted(self.requests[0].corpus)) if self.corpus_kind is not None and self.requests else ()

    def at_concurrency(self, c: int) -> Trace:
        """The trace as a closed loop at concurrency c sees it: the corpus kind's rows those of
        the largest recorded lag up to c (its own, lag 1, where none is), the rest unchanged."""
        lag = max((x for x in self.corpus_lags if x <= c), default=1)
        if lag == 1:
            return self
        k = self.kinds.index(self.corpus_kind)
        return replace(self, requests=tuple(r.with_rows(k, r.corpus[lag]) for r in self.requests))

    def as_dict(self) -> dict:
        return {"version": VERSION, "kinds": list(self.kinds), "block": self.block, "max_tokens": self.max_tokens,
                "requests": [r.as_dict() for r in self.requests], "costs": self.costs.as_dict(),
                "meta": self.meta} | ({} if self.corpus_kind is None else {"corpus_kind": self.corpus_kind})

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        if d.get("version") != VERSION:
            raise ValueError(f"unsupported trace version {d.get('version')!r} (this code reads {VERSION})")
        return cls(tuple(d["kinds"]), int(d["block"]), int(d["max_tokens"]),
                   tuple(RequestTrace.from_dict(r) for r in d["requests"]), TraceCosts.from_dict(d["costs"]),
                   dict(d.get("meta") or {}), d.get("corpus_kind"))


def _check_counts(count: np.ndarray, accepted: np.ndarray, width: int) -> None:
    """Drafts proposed and accepted by position ([..., T]: every kind's, or one's): accepted ≤
    count ≤ width, and none at position 0 (prefill's)."""
    if (accepted > count).any() or (count > width).any() or (count[..., 0] != 0).any():
        raise ValueError("accepted ≤ count ≤ block − 1, and nothing drafted at position 0")


def accepted_prefix(drafts: np.ndarray, truth: np.ndarray) -> int:
    """Leading drafts equal to the true continuation (as long as both last)."""
    n = min(len(drafts), len(truth))
    miss = np.nonzero(np.asarray(drafts[:n]) != np.asarray(truth[:n]))[0]
    return int(miss[0]) if len(miss) else n
