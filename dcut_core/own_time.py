"""The coordinator's own time per step against running requests: what the engine spends outside
the target's forward and the drafters' passes (scheduling, the drafting gate, pruning,
acceptance, commit), as `benchmarks/coordinator.py` measures it over a zero-cost target.

`dcut simulate` adds it to each simulated step, so an operator sees at which batch the
coordinator's Python becomes a visible share of a GPU step (issue #26, item 6). Between measured
batch sizes it is interpolated linearly, beyond the largest extrapolated along the last segment
(the measured growth is close to linear in requests there) — but never less steeply than plain
decoding's own time grows (any policy does `ar`'s per-request work and more), and never
downwards: a noisy pair of points (the first GPU run's `dcut`, 5.4 ms at 64 and 4.9 at 256) once
extrapolated to less own time at 1,024 requests than at 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OwnTime:
    """Per policy, (running requests, own ms per step) measured points, and where from."""

    points: dict[str, tuple[tuple[int, float], ...]]
    source: str

    def ms(self, policy: str, requests: int) -> float:
        """Own ms per step of `policy` at `requests` running (a policy not measured: `dcut`'s)."""
        pts = self.points.get(policy) or self.points["dcut"]
        r, y = (np.array(v, dtype=np.float64) for v in zip(*pts, strict=True))
        if requests <= r[-1]:
            return float(np.interp(requests, r, y))
        floor = self._last_slope(self.points["ar"]) if "ar" in self.points else 0.0
        return float(y[-1] + max(self._last_slope(pts), floor, 0.0) * (requests - r[-1]))

    @staticmethod
    def _last_slope(pts: tuple[tuple[int, float], ...]) -> float:
        """Own ms per added request along the last measured segment (0 with one point)."""
        if len(pts) < 2:
            return 0.0
        (r0, y0), (r1, y1) = pts[-2], pts[-1]
        return (y1 - y0) / (r1 - r0)

    @classmethod
    def from_records(cls, records: list[dict], source: str) -> OwnTime:
        """From `benchmarks/coordinator.py`'s results.json records (policy, requests, own_ms); a
        policy measured at several blocks keeps the first block's."""
        points: dict[str, dict[int, float]] = {}
        block: dict[str, int] = {}
        for rec in records:
            pol = rec["policy"]
            if block.setdefault(pol, rec["block"]) != rec["block"]:
                continue
            points.setdefault(pol, {})[int(rec["requests"])] = float(rec["own_ms"])
        if "dcut" not in points or "ar" not in points:
            raise ValueError("coordinator times need the ar and dcut policies measured")
        return cls({p: tuple(sorted(v.items())) for p, v in points.items()}, source)


# benchmarks/coordinator.py --forward model, 2026-12-05 (session 31, on 640dd30): the engine's own
# Python on this project's 2-core CPU machine (a serving host's cores are faster). The first
# measurement (2026-12-01) was 2-5 x these: ar 16.7 ms and dcut 20.0 ms at 1,024 requests.
MEASURED = OwnTime({"ar": ((1, 0.19), (16, 0.28), (64, 0.51), (256, 1.24), (1024, 3.41)),
                    "full": ((1, 0.70), (16, 0.89), (64, 1.36), (256, 2.91), (1024, 7.72)),
                    "tetris": ((1, 0.68), (16, 0.91), (64, 1.61), (256, 2.87), (1024, 7.65)),
                    "dcut-buckets": ((1, 0.82), (16, 0.97), (64, 1.65), (256, 2.87), (1024, 7.58)),
                    "dcut": ((1, 0.88), (16, 1.16), (64, 1.95), (256, 2.97), (1024, 4.87))},
                   "benchmarks/coordinator.py on the 2-core CPU machine, 2026-12-05")
