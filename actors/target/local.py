"""`LocalTarget`: the single-process target behind the same interface as `EPGroup`.

It is the reference the expert-parallel group is checked against, and the cheap path where one
process is enough (drafter training, small tests).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from actors.target.group import TargetOutput
from actors.target.layout import for_cpu
from actors.target.model import ForwardBatch, MoETransformer
from actors.target.moe import StepStats
from actors.target.sampling import draw, target_probs


class LocalTarget:
    """A model and its KV cache in this process."""

    def __init__(self, model: MoETransformer, kv_capacity_tokens: int = 65536, kv_block_size: int = 16) -> None:
        self.model = for_cpu(model)  # on the CPU, linear products posed for it (actors/target/layout.py)
        self.cache = model.new_cache(kv_capacity_tokens, kv_block_size)

    def forward(self, request_ids: list[int], chunks: list[list[int]], logits: str | list[list[int]] = "all",
                with_logits: bool = False, capture_layers: tuple[int, ...] = (),
                sampling: list[tuple[float, float, np.ndarray | None]] | None = None) -> TargetOutput:
        t0 = time.perf_counter()
        batch = ForwardBatch.from_lists(request_ids, chunks, "last" if logits == "last" else "all")
        if not isinstance(logits, str):
            starts = batch.cu[:-1].tolist()
            index = [s + p for s, pos in zip(starts, logits, strict=True) for p in pos]
            batch = ForwardBatch(batch.request_ids, batch.tokens, batch.cu, torch.tensor(index, dtype=torch.long))
        stats = StepStats()
        out, captured = self.model(batch, self.cache, stats, capture_layers)
        stats.settle()
        rows = [len(c) for c in chunks] if logits == "all" else [1] * len(chunks) if logits == "last" \
            else [len(p) for p in logits]
        rows_cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(rows, out=rows_cu[1:])
        argmax = out.argmax(-1).numpy()
        sampled = None
        if sampling is not None and max(t for t, _, _ in sampling) > 0:  # as a rank draws (worker.py)
            temp = torch.tensor([t for (t, _, _), n in zip(sampling, rows, strict=True) for _ in range(n)])
            top_p = torch.tensor([p for (_, p, _), n in zip(sampling, rows, strict=True) for _ in range(n)])
            u = torch.from_numpy(np.concatenate([np.zeros(n) if x is None else x
                                                 for (_, _, x), n in zip(sampling, rows, strict=True)]))
            draws = draw(target_probs(out, temp.float().clamp_min(1e-6), top_p.float()), u).numpy()
            sampled = np.where(temp.numpy() > 0, draws, argmax)  # the argmax where a request is greedy
        tok_splits = batch.cu[1:-1].tolist()
        features = [dict(zip(captured, hs, strict=True))
                    for hs in zip(*[[x.numpy() for x in torch.tensor_split(h, tok_splits)] for h in captured.values()],
                                  strict=True)] if captured else [{} for _ in chunks]
        return TargetOutput(argmax, rows_cu, out.float().numpy() if with_logits else None, features, [stats],
                            time.perf_counter() - t0, sampled)

    def truncate(self, lengths: dict[int, int]) -> None:
        self.cache.truncate_all(lengths)

    def release(self, request_ids: list[int]) -> None:
        self.cache.release_all(request_ids)
