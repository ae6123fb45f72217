"""Greedy speculative decoding in one process: target + drafter, every draft verified.

The measuring tool for drafters (docs/model.md: MAT, acceptance by position, calibration) and a
losslessness check; the distributed engine with pruning is `BatchCoordinator` (issue #5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut_core.rules import greedy


@dataclass
class SpecTrace:
    """Per request: output tokens; per step: drafted count, accepted count, draft confidences."""

    tokens: list[list[int]]
    drafted: list[list[int]] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    confidence: list[list[np.ndarray]] = field(default_factory=list)
    margin: list[list[np.ndarray]] = field(default_factory=list)

    def mat(self) -> float:
        """Mean accepted tokens per step per request, bonus included."""
        steps = [a for acc in self.accepted for a in acc]
        return float(np.mean(steps) + 1.0) if steps else 1.0

    def mat_per_request(self) -> np.ndarray:
        return np.array([np.mean(a) + 1.0 for a in self.accepted if a])


def speculative_greedy(target, drafter, request_ids: list[int], prompts: list[list[int]], max_new_tokens: int,
                       drafts_per_step: int, capture_layers: tuple[int, ...] = ()) -> SpecTrace:
    """Decode every prompt greedily with drafts verified by `target` (LocalTarget or EPGroup)."""
    r = len(prompts)
    pre = target.forward(request_ids, prompts, logits="last", capture_layers=capture_layers)
    last = pre.argmax[pre.rows_cu[1:] - 1].tolist()
    drafter.commit(request_ids, [[*p, t] for p, t in zip(prompts, last, strict=True)], pre.features)
    lengths = [len(p) for p in prompts]  # tokens in the target's cache
    trace = SpecTrace([[t] for t in last], [[] for _ in range(r)], [[] for _ in range(r)], [[] for _ in range(r)],
                      [[] for _ in range(r)])
    live = list(range(r))
    while live:
        ids = [request_ids[i] for i in live]
        want = [min(drafts_per_step, max_new_tokens - len(trace.tokens[i]) - 1) for i in live]
        d = drafter.draft(ids, [last[i] for i in live], want)
        chunks = [[last[i], *d.tokens[d.cu[j]:d.cu[j + 1]].tolist()] for j, i in enumerate(live)]
        out = target.forward(ids, chunks, logits="all", capture_layers=capture_layers)
        res = greedy(d.tokens, d.cu, out.argmax)
        keep, features, emitted = {}, [], []
        for j, i in enumerate(live):
            a = int(res.accepted[j])
            new = res.tokens[res.cu_tokens[j]:res.cu_tokens[j + 1]].tolist()
            trace.tokens[i] += new
            trace.drafted[i].append(int(d.cu[j + 1] - d.cu[j]))
            trace.accepted[i].append(a)
            trace.confidence[i].append(d.confidence[d.cu[j]:d.cu[j + 1]])
            trace.margin[i].append(d.margin[d.cu[j]:d.cu[j + 1]])
            lengths[i] += 1 + a
            keep[request_ids[i]] = lengths[i]
            features.append({k: h[:1 + a] for k, h in out.features[j].items()})
            emitted.append(new)
            last[i] = new[-1]
        target.truncate(keep)
        drafter.commit(ids, emitted, features)
        live = [i for i in live if len(trace.tokens[i]) < max_new_tokens]
    for t in trace.tokens:
        del t[max_new_tokens:]
    target.release(request_ids)
    drafter.release(request_ids)
    return trace
