"""One step's forward for the whole EP group as flat arrays (`VerifyBatch`): every request's
tokens, the rows whose outputs come back, per-row sampling, which requests' features stay on
their rank, which rows come back as log-probabilities, per-request controls. The engine builds
it with numpy (`actors/engine/verification.py`); the group only slices it per rank
(`VerifyBatch.share`) and reassembles the answers in request order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.target.worker import RankBatch
from dcut_core import ragged


@dataclass(frozen=True)
class VerifyBatch:
    """Requests in order; ragged by `cu` (tokens) and `rows_cu` (logit rows). `rows` are flat
    indices into `tokens`, each request's inside its own span. Per row: `temperature`, `top_p`,
    `uniform` (None: every row greedy). Per request: `keep_features` (captured rows stay on the
    rank; None: every request's come back), `logprobs` (its rows come back as log-probabilities
    too; None: none) and `controls` (a `sampling.RequestControls` or None each; None: none)."""

    request_ids: list[int]
    tokens: np.ndarray  # [T] int64
    cu: np.ndarray  # [N + 1] int64
    rows: np.ndarray  # [M] int64
    rows_cu: np.ndarray  # [N + 1] int64
    with_logits: bool = False
    capture_layers: tuple[int, ...] = ()
    temperature: np.ndarray | None = None  # [M] float32
    top_p: np.ndarray | None = None  # [M] float32
    uniform: np.ndarray | None = None  # [M] float64
    keep_features: np.ndarray | None = None  # [N] bool
    logprobs: np.ndarray | None = None  # [N] bool
    controls: tuple | None = None  # [N]

    @classmethod
    def of(cls, request_ids: list[int], chunks: list[list[int]], logits: str | list[list[int]] = "all",
           **per_request) -> VerifyBatch:
        """From per-request lists (tests, tools, the start-up profile): chunks[i] fed to
        request_ids[i]; `logits` "all", "last" or each request's positions inside its chunk;
        `per_request` as `EPGroup.forward` takes them (with_logits, capture_layers, sampling
        [(temperature, top_p, uniforms or None)], keep_features, logprobs, controls)."""
        if len(request_ids) != len(chunks):
            raise ValueError("one chunk per request, each request once")
        tokens, cu = ragged.flatten(chunks, dtype=np.int64)
        if logits == "all":
            rows, rows_cu = np.arange(int(cu[-1]), dtype=np.int64), cu
        elif logits == "last":
            rows, rows_cu = cu[1:] - 1, np.arange(len(chunks) + 1, dtype=np.int64)
        else:
            inside, rows_cu = ragged.flatten(logits, dtype=np.int64)
            rows = inside + np.repeat(cu[:-1], np.diff(rows_cu))
        return cls(list(request_ids), tokens, cu, rows, rows_cu, bool(per_request.get("with_logits", False)),
                   tuple(per_request.get("capture_layers", ())),
                   **per_row_sampling(per_request.get("sampling"), np.diff(rows_cu)),
                   keep_features=_flags(per_request.get("keep_features")), logprobs=_flags(per_request.get("logprobs")),
                   controls=None if per_request.get("controls") is None else tuple(per_request["controls"]))

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def row_counts(self) -> np.ndarray:
        return np.diff(self.rows_cu)

    def share(self, idx: np.ndarray | None, truncate: dict[int, int]) -> RankBatch:
        """The part of requests `idx` (in that order; None: every request, as it is) for their
        rank, with its roll-backs."""
        if idx is None:
            ids, rows, keep, controls = list(self.request_ids), slice(None), self.keep_features, self.controls
            tokens, cu, index, rows_cu = self.tokens, self.cu, self.rows, self.rows_cu
        else:
            idx = np.asarray(idx, dtype=np.int64)
            flat, cu = ragged.gather(self.cu, idx)
            rows, rows_cu = ragged.gather(self.rows_cu, idx)
            owner = np.repeat(np.arange(len(idx)), np.diff(rows_cu))
            tokens, index = self.tokens[flat], self.rows[rows] - self.cu[idx][owner] + cu[:-1][owner]
            ids = [self.request_ids[i] for i in idx.tolist()]
            keep = None if self.keep_features is None else self.keep_features[idx]
            controls = None if self.controls is None else tuple(self.controls[i] for i in idx.tolist())
        logprobs = None if self.logprobs is None else np.repeat(self.logprobs if idx is None else self.logprobs[idx],
                                                                np.diff(rows_cu))
        if controls is not None and all(c is None for c in controls):
            controls = None

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[rows]

        return RankBatch(ids, tokens, cu, index, self.with_logits, self.capture_layers, pick(self.temperature),
                         pick(self.top_p), truncate or None, keep, logprobs, controls, pick(self.uniform))


def per_row_sampling(sampling: list[tuple] | None, rows: np.ndarray) -> dict:
    """Per-row temperature, top-p and uniforms from per-request (temperature, top_p, uniforms or
    None: rows[i] zeros), or none of them when no request samples."""
    if sampling is None or not any(s[0] > 0 for s in sampling):
        return {"temperature": None, "top_p": None, "uniform": None}
    temp = np.repeat(np.array([s[0] for s in sampling], dtype=np.float32), rows)
    top_p = np.repeat(np.array([s[1] for s in sampling], dtype=np.float32), rows)
    uniform = np.concatenate([np.zeros(n) if s[2] is None else np.asarray(s[2], dtype=np.float64)
                              for s, n in zip(sampling, rows.tolist(), strict=True)] or [np.zeros(0)])
    return {"temperature": temp, "top_p": top_p, "uniform": uniform.astype(np.float64)}


def _flags(values) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=bool).reshape(-1)
