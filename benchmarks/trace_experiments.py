"""What the counterfactual traces say about the chooser and the gate (issue #24, item 3).

Exact replays (`dcut_core.trace_sim`), no end-to-end noise: every number is the simulated tok/s
of a setting over the ratio to plain decoding on the same trace. Signals are fitted on the
training trace only; the held-out trace is reported, never tuned on.

1. **Where the oracle's lead comes from**: the hindsight oracle with each kind alone and with
   every kind — knowing how many drafts pass (length) against knowing which kind to use.
2. **A free signal: the n-gram match.** Before drafting, the n-gram lookup knows how its draft
   was matched: its first draft's confidence is its match's length where one occurrence matched,
   the share of occurrences that agree where several did (`NgramDrafter`). On the training traces
   that confidence sorts the first draft's acceptance from 0.23–0.38 to 0.97–0.99 (session 45;
   the number of drafts available, this row's signal before, says nothing since loops are copied
   on). The n-gram kind's conditional acceptance by position is fitted per confidence bucket on
   the training trace, and the gate predicts the kind from that table (each request's own factor
   left out: with it the row gained less); the other kinds as the engine predicts them.
3. **Chains cut as they run** (dcut_core/chains.py, `EngineConfig.chain_stop`): MTP's chains cut
   pass by pass where the calibrated survival of their drafts no longer pays. The simulator
   charges nothing for the per-pass confidences the cut reads (session 24: off by default, since
   end to end they cost more than the cut saves).
4. **The step's own time**: the same settings with the drafting policy's own time per step (the
   gate, the chooser, learning, bookkeeping; `TraceCosts.own_policy`, `own_drafting`) at zero;
   and every kind charged what an engine of one kind spends (`own_one`, measured beside it: the
   chooser and the other kinds' bookkeeping free) — how much of `auto`'s deficit is its own time;
   and, where the trace prices the kind chooser's runs apart (`TraceCosts.choose`), every kind
   with the chooser free.
5. **Whose prediction is the loss**: the engine's gate (every kind) told in hindsight how many
   drafts of one kind would pass, the other kinds predicted as the engine does.

6. **The target's own confidence** (`--target-only`; traces recorded since session 47): each
   kind's acceptance by quintile of the target's top probability where it emitted the last token
   (`RequestTrace.target_confidence`), and the gate predicting the neural kinds from it.
7. **Hosting against choosing** (`--hosting-only`): `auto` beside a unit that hosts every kind but
   never drafts with the neural ones, and the same charged one kind's own time — how much of
   `auto`'s loss to n-gram alone is its choice, how much what hosting several kinds costs.

(Before session 20 experiment 2 replaced a tracker method the gate no longer called, and so
measured the stock gate twice; it now replaces the gate's predictions.)

    .venv/bin/python benchmarks/trace_experiments.py --train runs/train.trace \\
        --heldout runs/trace-validate2/heldout.trace --out runs/trace-experiments
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dcut_core.drafting import Predicted
from dcut_core.gate import DraftingGate, GateInput
from dcut_core.trace_sim import HindsightGate, SimSettings, _Run, oracle_run, simulate_trace

LEVELS = (1, 4, 16, 32)
KIND_SETS = (("ngram",), ("mtp",), ("block", "mtp", "ngram"))
EDGES = np.array([0.6, 0.76, 0.84, 0.88, 0.91])  # the n-gram kind's first-draft confidence, in 6 buckets


def bucket(confidence: float) -> int:
    return int(np.digitize(confidence, EDGES))


def match_key(trace):
    """(request, t) -> the n-gram kind's first-draft confidence bucket at t in `trace`."""
    ng = trace.kinds.index("ngram")
    return lambda r, t: bucket(r.confidence[ng, t, 0])


def fit_signal_table(trace) -> np.ndarray:
    """[buckets, positions] the n-gram kind's conditional acceptance by its first draft's
    confidence bucket (judged drafts only, smoothed toward 0.5)."""
    return fit_kind_table(trace, "ngram", match_key(trace), buckets=len(EDGES) + 1)


SURE_BUCKETS = 5  # the target's own confidence: quantile buckets of the training trace's positions


def sure_edges(trace) -> np.ndarray:
    """Inner edges of `SURE_BUCKETS` equal-count buckets of the target's confidence over the
    trace's draftable positions (t ≥ 1)."""
    sure = np.concatenate([r.target_confidence[1:] for r in trace.requests])
    return np.quantile(sure, np.arange(1, SURE_BUCKETS) / SURE_BUCKETS)


def fit_kind_table(trace, kind: str, key, buckets: int = 0) -> np.ndarray:
    """[buckets, positions] one kind's conditional acceptance by position, per bucket of
    `key(request, t)` (judged drafts only, smoothed toward 0.5; a bucket never seen is 0.5; at
    least `buckets` rows)."""
    width, k = trace.block - 1, trace.kinds.index(kind)
    hits, judged = {}, {}
    j = np.arange(width)
    for r in trace.requests:
        for t in range(1, r.length):
            n, a = r.count[k, t], r.accepted[k, t]
            if n:
                b = key(r, t)
                seen = (j <= min(a, n - 1)) & (j < n)
                hits[b] = hits.get(b, np.full(width, 0.5)) + ((j < a) & seen)
                judged[b] = judged.get(b, np.ones(width)) + seen
    out = np.full((max(buckets, max(hits, default=-1) + 1), width), 0.5)
    for b in hits:
        out[b] = hits[b] / judged[b]
    return out


class TableRun(_Run):
    """The engine's decisions, its gate predicting some kinds from tables of a free signal
    (experiment 2: n-gram from its match's table; 6: the neural kinds from the target's confidence)
    (`tables`: kind -> (key(request, t) -> bucket, [buckets, positions] rates)); `scaled`: the
    engine's own prediction times the bucket's rates over the kind's rates on the whole training
    trace (the request's own factor kept), else the bucket's rates alone."""

    def __init__(self, trace, settings, concurrency, tables: dict, overall: dict | None = None) -> None:
        super().__init__(trace, settings, concurrency)
        self.tables = {settings.kinds.index(k): v for k, v in tables.items() if k in settings.kinds}
        self.overall = None if overall is None else {settings.kinds.index(k): v for k, v in overall.items()
                                                     if k in settings.kinds}
        self.at: dict[int, tuple] = {}
        self.gate.predict = self._predict

    def _predict(self, g: GateInput) -> Predicted:
        own = DraftingGate.predict(self.gate, g)
        rates = own.rates.copy()
        for i, rid in enumerate(g.rids):
            rt, t = self.at[rid]
            for j, (key, table) in self.tables.items():
                n = int(own.lengths[i, j])
                if n:
                    row = table[min(key(rt, t), len(table) - 1), :n]
                    if self.overall is not None:
                        row = own.rates[i, j, :n] * row / np.maximum(self.overall[j][:n], 1e-6)
                    rates[i, j, :n] = np.clip(row, 0.0, 0.99)
        return Predicted(rates, own.lengths)

    def _plan(self, batch):
        self.at = {x.rid: (self.trace.requests[x.q], x.t) for x in batch}
        return super()._plan(batch)


def target_signal(train, trace) -> dict:
    """Experiment 6: the target's own confidence where it emitted the last token
    (`RequestTrace.target_confidence`): each kind's first three drafts' acceptance by its bucket,
    and the gate predicting the neural kinds from it (tables fitted on `train`)."""
    edges = sure_edges(train)
    sure = lambda r, t: int(np.digitize(r.target_confidence[t], edges))  # noqa: E731
    neural = [k for k in ("mtp", "block") if k in train.kinds]
    by_sure = {k: fit_kind_table(train, k, sure) for k in (*neural, "ngram")}
    overall = {k: fit_kind_table(train, k, lambda r, t: 0)[0] for k in neural}
    by_match = {"ngram": (match_key(trace), fit_signal_table(train))}
    out: dict = {"edges": [round(float(e), 3) for e in edges], "first3": {}, "runs": {}}
    for name, tr in (("train", train), ("held-out", trace)):  # accepted of the first three drafts, by bucket
        out["first3"][name] = {}
        for kind in (*neural, "ngram"):
            k = tr.kinds.index(kind)
            acc = [[] for _ in range(SURE_BUCKETS)]
            for r in tr.requests:
                for t in range(1, r.length):
                    if r.count[k, t]:
                        acc[sure(r, t)].append(min(3, int(r.accepted[k, t])))
            out["first3"][name][kind] = [round(float(np.mean(a)), 2) if a else None for a in acc]
    table = {k: (sure, by_sure[k]) for k in neural}
    for kinds in (("mtp",), ("mtp", "ngram"), KIND_SETS[-1]):
        s = SimSettings(kinds=kinds, block=8)
        name = "+".join(kinds)
        rows = {"stock": ratios(trace, lambda c, s=s: simulate_trace(trace, s, c), kinds),
                "neural kinds from the target's confidence": ratios(
                    trace, lambda c, s=s: TableRun(trace, s, c, table).run(), kinds),
                "neural kinds scaled by it": ratios(
                    trace, lambda c, s=s: TableRun(trace, s, c, table, overall).run(), kinds)}
        if "ngram" in kinds:
            rows["and n-gram from its match"] = ratios(
                trace, lambda c, s=s: TableRun(trace, s, c, {**table, **by_match}).run(), kinds)
        out["runs"][name] = rows
    alone = SimSettings(kinds=("ngram",), block=8)
    out["runs"]["ngram"] = {"stock": ratios(trace, lambda c: simulate_trace(trace, alone, c), ("ngram",))}
    return out


class NeverRun(_Run):
    """The engine's decisions in a unit that hosts `settings.kinds` but never drafts with any kind
    but `keep` (the others predicted to accept nothing; run it without the chooser's optimism,
    exploration or kind arms): what hosting them costs, apart from choosing them."""

    def __init__(self, trace, settings, concurrency, keep: str = "ngram") -> None:
        super().__init__(trace, settings, concurrency)
        self.others = [j for j, k in enumerate(settings.kinds) if k != keep]
        self.gate.predict = self._predict

    def _predict(self, g: GateInput) -> Predicted:
        own = DraftingGate.predict(self.gate, g)
        rates = own.rates.copy()
        rates[:, self.others] = 0.0
        return Predicted(rates, own.lengths)


QUIET = {"bonus": 0.0, "explore_every": 10**9, "explore_warmup": 0, "payoff_kind_arms": False}


def hosting(trace, prior=None) -> dict:
    """Experiment 7: where `auto` (every kind) loses to n-gram alone — its choice, or hosting
    several kinds. Tok/s × n-gram alone in the same replay, from the bundle's prior (`prior`, as
    served) or cold: `auto` as served; a unit that never drafts with the neural kinds; the same
    charged one kind's own time with the chooser free. Also how many request-steps each drafted
    with a neural kind."""
    every, costs = KIND_SETS[-1], trace.costs
    if costs.own_one is not None:
        costs = dataclasses.replace(costs, own_policy=costs.own_one[0], own_drafting=costs.own_one[1])
    one = dataclasses.replace(trace, costs=dataclasses.replace(costs, choose=None))

    def run(cls, tr, s, c, *extra):
        r = cls(tr, s, c, *extra)
        if prior is not None:
            prior.restore(s.kinds, r.calibrators, r.gate.trackers, r.gate.exploration)
        return r.run()

    base = [run(_Run, trace, SimSettings(kinds=("ngram",), block=8), c).tok_s for c in LEVELS]
    rows = {"auto": (_Run, trace, SimSettings(kinds=every, block=8)),
            "never the neural kinds": (NeverRun, trace, SimSettings(kinds=every, block=8, **QUIET)),
            "never them, one kind's own time, the chooser free": (NeverRun, one,
                                                                   SimSettings(kinds=every, block=8, **QUIET))}
    out = {}
    for name, (cls, tr, s) in rows.items():
        res = [run(cls, tr, s, c) for c in LEVELS]
        out[name] = {"ratio": [round(r.tok_s / b, 3) for r, b in zip(res, base, strict=True)],
                     "neural_steps": [sum(n for k, n in r.chosen.items() if k != "ngram") for r in res]}
    return out


class ToldRun(_Run):
    """The engine's gate told in hindsight how many drafts of some kinds (`told`) would pass,
    the others predicted as the engine predicts them: whose prediction `auto`'s loss is."""

    def __init__(self, trace, settings, concurrency, told: tuple[str, ...]) -> None:
        super().__init__(trace, dataclasses.replace(settings, hindsight=True), concurrency)
        self.told = [j for j, k in enumerate(settings.kinds) if k in told]
        self.gate.predict = self._predict

    def _predict(self, g: GateInput) -> Predicted:
        own = DraftingGate.predict(self.gate, g)
        rates = own.rates.copy()
        rates[:, self.told] = HindsightGate.predict(self.gate, g).rates[:, self.told]
        return Predicted(rates, own.lengths)


class AuditRun(_Run):
    """The engine's decisions, and at each one every kind's predicted and counterfactual accepted
    drafts of its first `AUDIT_DRAFTS` (as far as it may draft), by the kind chosen (-1: none)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.rows: list[tuple[int, int, float, int]] = []  # (chosen, kind, predicted, realized)
        self._pred: Predicted | None = None
        own = self.gate.predict

        def predict(g: GateInput) -> Predicted:
            self._pred = own(g)
            return self._pred

        self.gate.predict = predict
        self.gate.decide = self.gate._decide_whole  # every decision predicts (the plain-Python path asks no `predict`)

    def _plan(self, batch):
        self._pred = None
        lengths, kinds, fallback = super()._plan(batch)
        p = self._pred
        if p is not None:
            for i, x in enumerate(batch):
                rt, chosen = self.trace.requests[x.q], int(kinds[i]) if lengths[i] > 0 else -1
                for j, k in enumerate(self.kidx):
                    n = min(int(p.lengths[i, j]), AUDIT_DRAFTS)
                    if n > 0:
                        real = min(n, int(rt.accepted[k, x.t]), int(rt.count[k, x.t]))
                        self.rows.append((chosen, j, float(np.cumprod(p.rates[i, j, :n]).sum()), real))
        return lengths, kinds, fallback


AUDIT_DRAFTS = 3  # kinds compared at equal length: the first three drafts (the chosen lengths differ by kind)


def choice_audit(trace, prior, kinds=("block", "mtp", "ngram"), levels=(1, 4, 16)) -> dict:
    """{C: {chosen kind: {kind: [predicted, realized, decisions]}}} (`AuditRun`, from `prior`)."""
    out: dict = {}
    for c in levels:
        run = AuditRun(trace, SimSettings(kinds=kinds, block=8), c)
        if prior is not None:
            prior.restore(kinds, run.calibrators, run.gate.trackers, run.gate.exploration)
        run.run()
        rows = np.array(run.rows, dtype=np.float64).reshape(-1, 4)
        out[c] = {}
        for cj, ck in enumerate(kinds):
            picked = rows[rows[:, 0] == cj]
            out[c][ck] = {k: [round(float(picked[picked[:, 1] == j, 2].mean()), 2),
                              round(float(picked[picked[:, 1] == j, 3].mean()), 2), int((picked[:, 1] == j).sum())]
                          for j, k in enumerate(kinds) if (picked[:, 1] == j).any()}
    return out


def ratios(trace, run, kinds) -> list[float]:
    ar = [simulate_trace(trace, SimSettings(policy="ar", kinds=kinds[:1], block=8), c).tok_s for c in LEVELS]
    return [round(run(c).tok_s / a, 3) for c, a in zip(LEVELS, ar, strict=True)]


def experiments(train, trace, prior=None) -> dict:
    match = {"ngram": (match_key(trace), fit_signal_table(train))}
    out: dict = {"oracle": {}, "signal": {}, "early_stop": {}, "own_time_zero": {}, "own_time_one": {}, "told": {},
                 "audit": choice_audit(trace, prior)}
    for kinds in (("ngram",), ("mtp",), ("block",), ("mtp", "ngram"), ("block", "mtp", "ngram")):
        out["oracle"]["+".join(kinds)] = ratios(trace, lambda c, k=kinds: oracle_run(trace, k, c, 8), kinds)
    zero = (0.0, 0.0)  # an engine of one kind has its own measured own time (`own_one`): zero that too
    quiet = dataclasses.replace(trace, costs=dataclasses.replace(
        trace.costs, own_policy=zero, own_drafting=zero, own_one=None if trace.costs.own_one is None else (zero, zero)))
    for kinds in KIND_SETS:
        s = SimSettings(kinds=kinds, block=8)
        name = "+".join(kinds)
        out["signal"][name] = {"stock": ratios(trace, lambda c, s=s: simulate_trace(trace, s, c), kinds)}
        if "ngram" in kinds:
            out["signal"][name]["n-gram match-confidence table"] = ratios(
                trace, lambda c, s=s: TableRun(trace, s, c, match).run(), kinds)
        cut = dataclasses.replace(s, chain_stop=True)
        out["early_stop"][name] = ratios(trace, lambda c, s=cut: simulate_trace(trace, s, c), kinds)
        out["own_time_zero"][name] = ratios(quiet, lambda c, s=s: simulate_trace(quiet, s, c), kinds)
    every = KIND_SETS[-1]
    s = SimSettings(kinds=every, block=8)
    if trace.costs.own_one is not None:  # every kind hosted, each step charged one kind's own time
        one = dataclasses.replace(trace, costs=dataclasses.replace(
            trace.costs, own_policy=trace.costs.own_one[0], own_drafting=trace.costs.own_one[1], choose=None))
        out["own_time_one"]["+".join(every)] = ratios(one, lambda c: simulate_trace(one, s, c), every)
    if trace.costs.choose is not None:  # every kind hosted, the chooser's runs free
        free = dataclasses.replace(trace, costs=dataclasses.replace(trace.costs, choose=(0.0, 0.0)))
        out["chooser_free"] = {"+".join(every): ratios(free, lambda c: simulate_trace(free, s, c), every)}
    for told in (("ngram",), ("mtp",), ("block",), every):
        out["told"]["+".join(told)] = ratios(trace, lambda c, t=told: ToldRun(trace, SimSettings(kinds=every, block=8),
                                                                              c, t).run(), every)
    return out


def render(name: str, res: dict) -> str:
    head = " | ".join(f"C = {c}" for c in LEVELS)
    lines = [f"#### {name}", "", f"| experiment | setting | {head} |", "|---|---|" + "---|" * len(LEVELS)]
    for kinds, row in res["oracle"].items():
        lines.append(f"| hindsight oracle | {kinds} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    for kinds, rows in res["signal"].items():
        for variant, row in rows.items():
            lines.append(f"| trackers: {variant} | {kinds} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    for kinds, row in res["early_stop"].items():
        lines.append(f"| chains cut (`chain_stop`) | {kinds} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    for kinds, row in res["own_time_zero"].items():
        lines.append(f"| policy's own time at 0 | {kinds} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    for kinds, row in res.get("own_time_one", {}).items():
        lines.append(f"| one kind's own time | {kinds} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    for kinds, row in res.get("chooser_free", {}).items():
        lines.append(f"| the kind chooser free | {kinds} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    for told, row in res["told"].items():
        lines.append(f"| gate told {told}'s accepted lengths | block+mtp+ngram | " +
                     " | ".join(f"{x:.2f}" for x in row) + " |")
    lines += ["", f"Chooser's audit (`auto` from the bundle's prior): predicted / realized accepted of the first "
              f"{AUDIT_DRAFTS} drafts", "", "| C | kind chosen | decisions | " +
              " | ".join(f"{k} predicted / realized" for k in ("block", "mtp", "ngram")) + " |", "|---" * 6 + "|"]
    for c, by in res["audit"].items():
        for chosen, kinds in by.items():
            if chosen in kinds:
                cells = " | ".join(f"{v[0]:.2f} / {v[1]:.2f}" if v else "" for v in
                                   (kinds.get(k) for k in ("block", "mtp", "ngram")))
                lines.append(f"| {c} | {chosen} | {kinds[chosen][2]} | {cells} |")
    return "\n".join(lines)


def render_hosting(name: str, res: dict) -> str:
    head = " | ".join(f"C = {c}" for c in LEVELS)
    lines = [f"#### {name}: hosting every kind against choosing (× n-gram alone)", "",
             f"| unit | {head} | request-steps drafted by a neural kind |", "|---|" + "---|" * (len(LEVELS) + 1)]
    for unit, row in res.items():
        lines.append(f"| {unit} | " + " | ".join(f"{x:.3f}" for x in row["ratio"]) +
                     f" | {', '.join(map(str, row['neural_steps']))} |")
    return "\n".join(lines)


def render_target(name: str, res: dict) -> str:
    head = " | ".join(f"C = {c}" for c in LEVELS)
    lines = [f"#### {name}: the target's own confidence (bucket edges {res['edges']})", "",
             "| trace | kind | " + " | ".join(f"bucket {b}" for b in range(SURE_BUCKETS)) + " |",
             "|---|---|" + "---|" * SURE_BUCKETS]
    for trace_name, kinds in res["first3"].items():
        for kind, row in kinds.items():
            cells = " | ".join("" if x is None else f"{x:.2f}" for x in row)
            lines.append(f"| {trace_name} | {kind} | {cells} |")
    lines += ["", f"| kinds | gate | {head} |", "|---|---|" + "---|" * len(LEVELS)]
    for kinds, rows in res["runs"].items():
        for variant, row in rows.items():
            lines.append(f"| {kinds} | {variant} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="a trace of training prompts (dcut trace --seed 23)")
    p.add_argument("--heldout", required=True, help="a trace of the reported prompts")
    p.add_argument("--prior", default=None, help="the prior the chooser's audit starts from (default: the bundle's)")
    p.add_argument("--out", default="runs/trace-experiments")
    p.add_argument("--target-only", action="store_true",
                   help="only experiment 6 (the target's own confidence; traces recorded since session 47)")
    p.add_argument("--hosting-only", action="store_true",
                   help="only experiment 7 (hosting every kind against choosing), cold and from the prior")
    args = p.parse_args()
    from dcut_core.learned import LearnedState
    from deployments.bundle import BUNDLED
    from deployments.trace_command import read_trace

    train = read_trace(args.train)
    prior = LearnedState.from_dict(json.loads(pathlib.Path(args.prior or BUNDLED / "prior.json").read_text()))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.hosting_only:
        res = {phase: hosting(read_trace(args.heldout), p) for phase, p in (("cold", None), ("from the prior", prior))}
        md = "\n\n".join(render_hosting(f"held-out trace, {phase}", r) for phase, r in res.items())
        stem = "hosting"
    elif args.target_only:
        res = target_signal(train, read_trace(args.heldout))
        md, stem = render_target("held-out trace", res), "target"
    else:
        res = {name: experiments(train, read_trace(path), prior) for name, path in
               (("training trace", args.train), ("held-out trace", args.heldout))}
        md = "\n\n".join(render(name, r) for name, r in res.items())
        stem = "results"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / ("tables.md" if stem == "results" else f"{stem}.md")).write_text(md + "\n")
    print(md)
    return 0

if __name__ == "__main__":
    sys.exit(main())
