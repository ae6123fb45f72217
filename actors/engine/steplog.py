"""A compact, append-only log of every decode step (msgpack), for replay and for the simulator.

Each record holds what `dcut_core` saw and decided — per request drafted count, survivals,
kept and accepted counts — and the step's predicted and measured times, so a pruning policy can
be re-run offline on real acceptance traces (`read_steps`). It also holds the drafting gate's
whole input and plan (`gate`) and what its acceptance tracker learnt (`observed`), so
`dcut_core.gate.replay` re-runs the gate over the same history. msgpack keeps this small and
streamable: one record per step, no framing of our own.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import msgpack
import numpy as np


class StepLog:
    """Appends step records to a file; closed with the engine."""

    def __init__(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "ab")  # noqa: SIM115 - lives as long as the engine
        self._pack = msgpack.Packer()

    def write(self, policy: str, st, learnt, late: bool = False) -> None:
        """One step (`Step`), with what the estimators took from it (`Learnt`): the drafting
        gate's input and plan when it decided, and what the trackers learnt — `late`: after the
        next step's gate decided (the engine learns a step while the next one's forward runs)."""
        seen = st.plan.seen if st.plan is not None else None
        self._f.write(self._pack.pack({
            "policy": policy,
            "drafted": st.drafts.counts.astype(np.int32).tolist(),
            "survival": [] if st.pruned.survival is None else np.asarray(st.pruned.survival, np.float32).tolist(),
            "kept": np.asarray(st.pruned.kept, dtype=np.int32).tolist(),
            "accepted": [int(a) for a in st.accepted.counts],
            "context": int(st.context),
            "predicted_s": float(learnt.predicted_s),
            "measured_s": float(st.out.wall_s),
            "draft_s": float(st.drafts.seconds),
            "gate": None if seen is None else {"input": seen.as_dict(),
                                               "lengths": st.plan.lengths.astype(np.int64).tolist(),
                                               "kinds": st.plan.kinds.astype(np.int64).tolist()},
            "observed": learnt.observed,
            "late": late,
        }))

    def close(self) -> None:
        self._f.close()


def read_steps(path: str | pathlib.Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        yield from msgpack.Unpacker(f, raw=False)

