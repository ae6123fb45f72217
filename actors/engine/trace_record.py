"""Recording a counterfactual trace (`dcut trace`; the format is `dcut_core.counterfactual`).

1. The greedy output of every prompt, from a plain decoding loop of the target (what every
   lossless policy produces).
2. The target's features at every position of prompt + output, from one forward per request
   (as float16, as the engine hands them to drafters), and from the same forward its own top
   probability where it emitted each output token (`RequestTrace.target_confidence`).
3. Every hosted drafter kind, built as the engine builds it, walks every request position by
   position through its own `commit` / `draft` protocol: at output position t it has been given
   the context up to t, drafts block − 1 tokens, and the drafts are compared with the output.
   Drafts of n < block − 1 are the first n of these (one pass drafts the block; a chain drafts
   in order; n-gram lookup truncates), so one walk serves every length a policy may ask for.
   The n-gram kind also drafts from the outputs of requests served before (its corpus): it
   walks the requests one after another, as one request at a time would run, each request's
   output joining the corpus when it ends.
4. The unit's costs: an engine built as `dcut serve` builds it serves the prompts once with the
   `dcut` policy and once plain, and what it measured is read back (cost model and correction,
   the step's own time); each kind's drafting rates from an engine hosting it alone.

Float results of a batched verify forward may differ from this one in the last bits, so a draft
can differ from the engine's at a near-tie: the trace is exact up to those (the validation table
in docs/benchmarks.md says how close the simulator then comes).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from actors.drafter.ngram import NgramDrafter
from actors.engine.config import EngineConfig
from actors.engine.lookahead import LOCAL_KIND
from actors.engine.replica import build_drafter
from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.local import LocalTarget
from dcut_core.counterfactual import ROWS, KindRows, RequestTrace, Trace, TraceCosts, accepted_prefix
from dcut_core.drafting import DraftCost

log = logging.getLogger(__name__)

# The corpus lags (closed-loop concurrencies, roughly) the n-gram kind's rows are walked at beside
# its own (lag 1): at 16 requests a trace walked in turn credits it ~6 % more accepted drafts than
# its corpus holds then (docs/benchmarks.md, session 48). A replay takes the largest up to its
# concurrency (`Trace.at_concurrency`).
CORPUS_LAGS = (4, 16, 64)
# The closed loops a trace measures the step's own time over: its lines a + b·R are read by
# replays at every concurrency, and fitted at 1–16 alone, at 32 requests they charged a plain step
# 1.05 ms where a run took 1.66, and a drafting step 6.4 where it took 5.7 (docs/benchmarks.md,
# session 48).
OWN_LEVELS = (1, 4, 16, 64)


def record_trace(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int, cost_rounds: int = 1,
                 meta: dict | None = None) -> Trace:
    """The trace of `prompts` under the engine configured by `cfg` (its hosted kinds, block)."""
    t0 = time.perf_counter()
    model = load_model(cfg.target_dir)
    room = max(map(len, prompts)) + max_tokens + cfg.block + 16
    outputs = greedy_decode(LocalTarget(model, kv_capacity_tokens=len(prompts) * room), list(range(len(prompts))),
                            prompts, max_tokens, cfg.eos_token_id)
    drafters = [NgramDrafter(block_size=cfg.block, corpus_tokens=cfg.ngram_corpus_tokens) if kind == LOCAL_KIND
                else build_drafter(cfg.drafter_spec(), kind) for kind in cfg.kinds]
    layers = tuple(sorted({layer for d in drafters for layer in getattr(d, "target_layers", ())}))
    features, sure = _target_views(model, prompts, outputs, layers, room)
    width = cfg.block - 1
    walks = [_walk_in_turn(d, prompts, outputs, features, width) if getattr(d, "corpus", None) is not None else
             _walk(d, prompts, outputs, features, width) for d in drafters]
    corpus_kind = next((k for k, d in zip(cfg.kinds, drafters, strict=True) if getattr(d, "corpus", None) is not None),
                       None)
    lagged = {} if corpus_kind is None else {  # the corpus kind's rows as closed loops at higher concurrency see them
        lag: _walk_in_turn(NgramDrafter(block_size=cfg.block, corpus_tokens=cfg.ngram_corpus_tokens), prompts,
                           outputs, features, width, lag) for lag in CORPUS_LAGS}
    requests = tuple(RequestTrace(len(p), np.asarray(o, dtype=np.int64),
                                  *(np.stack([w[name][i] for w in walks]) for name in ROWS),
                                  sure[i], {lag: KindRows(*(w[name][i] for name in ROWS))
                                            for lag, w in lagged.items()} if corpus_kind is not None else None)
                     for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)))
    log.info("trace of %d requests walked in %.1f s", len(prompts), time.perf_counter() - t0)
    costs = measure_costs(cfg, prompts, max_tokens, cost_rounds)
    return Trace(cfg.kinds, cfg.block, max_tokens, requests, costs, dict(meta or {}), corpus_kind)


def _target_views(model, prompts, outputs, layers, room) -> tuple[list[dict[int, np.ndarray]], list[np.ndarray]]:
    """Per request, from one forward over prompt + output[:-1]: layer -> [len(prompt) +
    len(output) − 1, H] float16, the target's outputs at every position a drafter may be given
    (all but the newest token's; {} without `layers`); and [T] float32, at row t the target's top
    probability where it emitted output[t − 1] (the prompt's last position for t = 1; row 0 is
    0) — what a verify step knows of its own last token before the next step drafts."""
    target = LocalTarget(model, kv_capacity_tokens=room)
    features, sure = [], []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        with torch.no_grad():
            res = target.forward([i], [[*p, *o[:-1]]], logits=[list(range(len(p) - 1, len(p) + len(o) - 1))],
                                 with_logits=True, capture_layers=layers)
        target.release([i])
        features.append({k: np.asarray(v, dtype=np.float16) for k, v in res.features[0].items()})
        top = torch.softmax(torch.from_numpy(res.logits).double(), dim=-1).max(dim=-1).values.numpy()
        row = np.zeros(len(o), dtype=np.float32)
        row[1:] = top[:-1]  # logits row j emitted output[j]; drafting at t follows output[t − 1]
        sure.append(row)
    return features, sure


def _walk_in_turn(drafter, prompts, outputs, features, width: int, lag: int = 1) -> dict[str, list[np.ndarray]]:
    """`_walk` one request at a time, in order: a drafter that learns from the requests it has
    served (the n-gram kind's corpus) sees the outputs of those `lag` or more places before each
    one (lag 1: every one before it)."""
    walks = []
    for p, o, f in zip(prompts, outputs, features, strict=True):
        walks.append(_walk(drafter, [p], [o], [f], width))
        drafter.absorb(leave=lag - 1)
    return {name: [w[name][0] for w in walks] for name in walks[0]}


def _walk(drafter, prompts, outputs, features, width: int) -> dict[str, list[np.ndarray]]:
    """One kind's drafts at every position of every request (all requests in one batch)."""
    n = len(prompts)
    longest = max(map(len, outputs))
    shape = [(len(o),) for o in outputs]
    rec = {"count": [np.zeros(s, np.int64) for s in shape], "accepted": [np.zeros(s, np.int64) for s in shape],
           "confidence": [np.zeros((*s, width), np.float32) for s in shape],
           "margin": [np.zeros((*s, width), np.float32) for s in shape],
           "tokens": [np.full((*s, width), -1, np.int64) for s in shape]}
    rids = list(range(n))
    drafter.commit(rids, [[*p, o[0]] for p, o in zip(prompts, outputs, strict=True)],
                   [{k: v[:len(p)] for k, v in f.items()} for p, f in zip(prompts, features, strict=True)])
    for t in range(1, longest):
        live = [i for i in rids if t < len(outputs[i])]
        out = drafter.draft(live, [outputs[i][t - 1] for i in live], [width] * len(live))
        for j, i in enumerate(live):
            sl = slice(out.cu[j], out.cu[j + 1])
            c = sl.stop - sl.start
            rec["count"][i][t] = c
            rec["tokens"][i][t, :c] = out.tokens[sl]
            rec["confidence"][i][t, :c] = out.confidence[sl]
            rec["margin"][i][t, :c] = out.margin[sl]
            rec["accepted"][i][t] = accepted_prefix(out.tokens[sl], np.asarray(outputs[i][t:]))
        at = [len(prompts[i]) + t - 1 for i in live]  # the position just processed: the token before output[t]
        drafter.commit(live, [[outputs[i][t]] for i in live],
                       [{k: v[a:a + 1] for k, v in features[i].items()} for i, a in zip(live, at, strict=True)])
    drafter.release(rids)
    return rec


def measure_costs(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int, rounds: int = 1) -> TraceCosts:
    """What an engine built from `cfg` measures serving the prompts in closed loops at 1, 4, 16
    and 64 requests (`OWN_LEVELS`, as many as it may run), with `dcut` and plain: the verify cost
    model refitted to every forward measured (not the start-up profile times one running
    correction), what a drafting call adds, and the step's own time outside the passes — the
    time between steps included, since a closed loop's wall clock counts it — fitted as a + b·R
    for plain steps, for `dcut` steps that draft nothing, and for drafting steps; in a unit of
    several kinds the kind chooser's runs are timed apart (`ChooserClock`), left out of those
    lines and fitted as a + b·R a run, so a replay charges them where they run.

    Each kind's drafting rates come from an engine hosting that kind alone (`_alone`): in a unit
    of several, a kind the chooser seldom picks is timed a few dozen times, and one recording
    of the held-out prompts priced the block drafter's pass at 12.8 ms where it takes 4.2
    (docs/benchmarks.md, session 20) — a simulator then all but never drafts with it. Each
    kind's own time inside a replica call is what the unit measures of it too. The engine of
    the cheapest kind alone also gives the own time the simulator charges a one-kind setting
    (the kind chooser and the per-kind learning are what several kinds add). The engines'
    saved learned state is left as it was found."""
    from actors.engine.coordinator import Engine

    engine = Engine(cfg)
    engine.warm_start.path = None  # it serves the trace's prompts to measure, not to learn for later engines
    clock = ChooserClock(engine) if len(cfg.kinds) > 1 else None
    try:
        own = _own_times(engine, prompts, max_tokens, rounds, ("dcut", "ar"), clock)
        engine.cost.refit()
        learner = engine.draft_cost
        plain, gated, drafting = (_line(own[k]) for k in ("ar", "dcut", "drafting"))
        costs = TraceCosts(engine.cost.model, engine.cost.scale, tuple(DraftCost(*_fields(d)) for d in learner.costs),
                           float(learner.shared), plain, _minus(gated, plain), _minus(drafting, gated),
                           choose=None if clock is None or not clock.runs else _line(clock.runs))
    finally:
        engine.shutdown()
    if len(cfg.kinds) == 1:
        return costs
    cheapest = "ngram" if "ngram" in cfg.kinds else cfg.kinds[0]
    draft, own_one = [], None
    for kind in cfg.kinds:
        cost, own = _alone(cfg, kind, prompts, max_tokens, rounds)
        draft.append(cost)
        if kind == cheapest:
            gated, drafting = _line(own["dcut"]), _line(own["drafting"])
            own_one = (_minus(gated, plain), _minus(drafting, gated))
    return dataclasses.replace(costs, draft=tuple(draft), own_one=own_one)


def _alone(cfg: EngineConfig, kind: str, prompts: list[list[int]], max_tokens: int,
           rounds: int) -> tuple[DraftCost, dict[str, list[tuple[int, float]]]]:
    """One kind's drafting rates, from an engine hosting it alone that serves the prompts with
    `dcut` (refitted to its last passes: no running level correction), and that engine's own
    times."""
    from actors.engine.coordinator import Engine

    one = Engine(dataclasses.replace(cfg, drafter=kind))
    one.warm_start.path = None
    try:
        own = _own_times(one, prompts, max_tokens, rounds, ("dcut",))
        one.draft_cost.refit()
        return DraftCost(*_fields(one.draft_cost.costs[0])), own
    finally:
        one.shutdown()


class ChooserClock:
    """Times the kind chooser inside an engine's steps: each run's (requests, seconds), and the
    seconds a step spent choosing (`spent`, by its record), so the step's own time can leave
    them out. Installed on the engine's gate for as long as the engine measures."""

    def __init__(self, engine) -> None:
        self.runs: list[tuple[int, float]] = []
        self.spent: dict[int, float] = {}  # id(step record) -> seconds its plan spent choosing
        self._now = 0.0
        chooser, step = engine.gate.chooser, engine.step
        choose = chooser.choose

        def timed_choose(q):
            t0 = time.perf_counter()
            try:
                return choose(q)
            finally:
                seconds = time.perf_counter() - t0
                self.runs.append((len(q.predicted.rates), seconds))
                self._now += seconds

        def timed_step():
            self._now = 0.0
            rec = step()
            if rec is not None:
                self.spent[id(rec)] = self._now
            return rec

        chooser.choose, engine.step = timed_choose, timed_step


def _own_times(engine, prompts: list[list[int]], max_tokens: int, rounds: int, policies: tuple[str, ...],
               clock: ChooserClock | None = None) -> dict[str, list[tuple[int, float]]]:
    """(requests, seconds) of every decode step's own time, by plain (`ar`), `dcut` drafting
    nothing (`dcut`) and drafting (`drafting`), over closed loops at `OWN_LEVELS` requests (as
    many as the prompts and the engine allow); less the kind chooser's runs where a `clock` times
    them."""
    from actors.engine.loadgen import closed_loop

    own: dict[str, list[tuple[int, float]]] = {"ar": [], "dcut": [], "drafting": []}
    spent = clock.spent if clock is not None else {}
    for _ in range(rounds):
        for c in sorted({min(c, len(prompts), engine.cfg.max_running) for c in OWN_LEVELS}):
            for policy in policies:
                engine.set_policy(policy)
                res = closed_loop(engine, prompts, c, max_tokens)
                between = (res.wall_s - sum(r.step_s for r in res.records)) / max(1, len(res.records))
                for r in res.records:
                    if not r.prefill_tokens:  # prefill's own bookkeeping would blur it
                        key = policy if policy == "ar" or not r.drafted else "drafting"
                        own[key].append((r.requests, r.step_s - r.target_compute_s - r.draft_s + between
                                         - spent.get(id(r), 0.0)))
                spent.clear()
    return own


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """a + b·R through (R, seconds), least squares; a constant when R does not vary."""
    if not points:
        return 0.0, 0.0
    r, y = np.array(points, dtype=np.float64).T
    if np.ptp(r) == 0:
        return float(np.median(y)), 0.0
    b, a = np.polyfit(r, y, 1)
    return float(a), float(b)


def _minus(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] - b[0], a[1] - b[1]


def _fields(d: DraftCost) -> tuple[float, ...]:
    return float(d.fixed), float(d.per_request), float(d.per_position), float(d.per_context), float(d.per_pass)
