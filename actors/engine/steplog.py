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

from dcut_core.drafting import DraftCost


class StepLog:
    """Appends step records to a file; closed with the engine."""

    def __init__(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "ab")  # noqa: SIM115 - lives as long as the engine
        self._pack = msgpack.Packer()

    def write(self, policy: str, drafted: np.ndarray, survival: np.ndarray | None, kept: np.ndarray,
              accepted: np.ndarray, context: int, predicted_s: float, measured_s: float, draft_s: float,
              gate: tuple | None = None, observed: dict | None = None) -> None:
        """One step; `gate` is the drafting gate's (GateInput, lengths) when it decided."""
        self._f.write(self._pack.pack({
            "policy": policy,
            "drafted": np.asarray(drafted, dtype=np.int32).tolist(),
            "survival": [] if survival is None else np.asarray(survival, dtype=np.float32).tolist(),
            "kept": np.asarray(kept, dtype=np.int32).tolist(),
            "accepted": np.asarray(accepted, dtype=np.int32).tolist(),
            "context": int(context),
            "predicted_s": float(predicted_s),
            "measured_s": float(measured_s),
            "draft_s": float(draft_s),
            "gate": None if gate is None else {"input": gate[0].as_dict(),
                                               "lengths": np.asarray(gate[1], dtype=np.int64).tolist(),
                                               "kinds": None if isinstance(gate[0].draft, DraftCost) else
                                               np.asarray(gate[2], dtype=np.int64).tolist()},
            "observed": observed,
        }))

    def close(self) -> None:
        self._f.close()


def read_steps(path: str | pathlib.Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        yield from msgpack.Unpacker(f, raw=False)


def observed(st) -> dict:
    """What the acceptance tracker learnt from a step (`dcut_core.gate.replay` feeds it back):
    per request kept and accepted counts, and the calibrated estimates of the drafts past the kept
    ones (ragged, `beyond_cu`; None when nothing was drafted)."""
    drafts, kept, est = st.drafts, st.kept, st.drafts.estimate
    beyond = [] if est is None else [est[drafts.cu[i] + kept[i]:drafts.cu[i + 1]] for i in range(len(st.batch))]
    return {"rids": [s.rid for s in st.batch], "kept": np.asarray(kept).tolist(),
            "kinds": None if drafts.kinds is None else np.asarray(drafts.kinds).tolist(),
            "empty": [list(e) for e in st.empty or ()],
            "accepted": [int(a) for a in st.accepted],
            "beyond": np.concatenate(beyond).tolist() if beyond else [],
            "beyond_cu": None if est is None else np.concatenate([[0], np.cumsum([len(b) for b in beyond])]).tolist()}
