"""Paged KV cache: one fixed pool of token slots per rank, handed out in blocks.

Memory is bounded by configuration (`capacity_tokens`); a request that would exceed it gets
`KVCacheFull` before anything is written, so the cache is never left half-updated. Requests own
a block table; slot of position t = table[t // block] * block + t % block. Rollback of rejected
drafts is `truncate`, which frees whole blocks past the new length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class KVCacheFull(RuntimeError):
    """The configured KV memory cannot hold the requested tokens."""


@dataclass(frozen=True)
class CacheSpec:
    layers: int
    kv_heads: int
    head_dim: int
    capacity_tokens: int
    block_size: int = 16
    value_dim: int | None = None  # width of V; None: head_dim; 0: no V (latent attention keeps one row)

    @property
    def bytes_per_token(self) -> int:
        """Cached values per token over all layers (times the dtype's size for bytes)."""
        v = self.head_dim if self.value_dim is None else self.value_dim
        return self.layers * self.kv_heads * (self.head_dim + v)


def tokens_for_memory(total_bytes: int, used_bytes: int, utilization: float, bytes_per_token: int,
                      block_size: int, reserve_bytes: int = 0) -> int:
    """KV tokens (whole blocks) that fit in `utilization` of a device's memory beside what is in
    use already (the weights) and `reserve_bytes` kept for a step's activations."""
    room = utilization * total_bytes - used_bytes - reserve_bytes
    return max(0, int(room // bytes_per_token) // block_size * block_size)


class PagedKVCache:
    """Owns K/V tensors [layers, slots, kv_heads, head_dim] and each request's block table."""

    def __init__(self, spec: CacheSpec, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        if spec.capacity_tokens < spec.block_size:
            raise ValueError("KV capacity must hold at least one block")
        self.spec = spec
        self.num_blocks = spec.capacity_tokens // spec.block_size
        slots = self.num_blocks * spec.block_size
        self.k = torch.zeros(spec.layers, slots, spec.kv_heads, spec.head_dim, dtype=dtype, device=device)
        v_dim = spec.head_dim if spec.value_dim is None else spec.value_dim
        self.v = torch.zeros(spec.layers, slots, spec.kv_heads, v_dim, dtype=dtype, device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low blocks first
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._scratch: int | None = None

    # -- bookkeeping ----------------------------------------------------------------------------

    def __contains__(self, rid: int) -> bool:
        return rid in self._tables

    def length(self, rid: int) -> int:
        return self._lengths[rid]

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.spec.block_size

    @property
    def requests(self) -> list[int]:
        return list(self._tables)

    def _blocks_needed(self, rid: int, new_len: int) -> int:
        have = len(self._tables.get(rid, ()))
        return max(0, -(-new_len // self.spec.block_size) - have)

    def reserve(self, growth: dict[int, int]) -> None:
        """Make room for `growth[rid]` more tokens of each request, all or nothing."""
        need = sum(self._blocks_needed(rid, self._lengths.get(rid, 0) + n) for rid, n in growth.items())
        if need > len(self._free):
            raise KVCacheFull(
                f"KV cache full: {need} blocks of {self.spec.block_size} tokens needed, "
                f"{len(self._free)} free (capacity {self.num_blocks * self.spec.block_size} tokens)"
            )
        for rid, n in growth.items():
            table = self._tables.setdefault(rid, [])
            self._lengths.setdefault(rid, 0)
            for _ in range(self._blocks_needed(rid, self._lengths[rid] + n)):
                table.append(self._free.pop())

    def commit(self, rid: int, n: int) -> None:
        """Record that n tokens were written after the current end of request rid."""
        self._lengths[rid] += n

    def truncate(self, rid: int, new_len: int) -> None:
        """Drop every token of rid at position >= new_len (rejected drafts) and free their blocks."""
        if not 0 <= new_len <= self._lengths[rid]:
            raise ValueError(f"cannot truncate request {rid} of length {self._lengths[rid]} to {new_len}")
        self._lengths[rid] = new_len
        table = self._tables[rid]
        keep = -(-new_len // self.spec.block_size)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]

    def truncate_all(self, lengths: dict[int, int]) -> None:
        """`truncate` for many requests: request -> new length."""
        for rid, n in lengths.items():
            self.truncate(rid, n)

    def release_all(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.release(rid)

    def release(self, rid: int) -> None:
        """Forget a finished request and free all its blocks."""
        if rid in self._tables:
            self._free.extend(reversed(self._tables.pop(rid)))
            del self._lengths[rid]

    def scratch_slot(self) -> int:
        """A slot no request will own: the first of a free block taken out of the pool for good
        on the first call (the padding of graphed steps writes its keys there)."""
        if self._scratch is None:
            if not self._free:
                raise KVCacheFull("no free block left for the scratch slot")
            block = max(self._free)
            self._free.remove(block)
            self._scratch = block * self.spec.block_size
        return self._scratch

    # -- slot arithmetic ------------------------------------------------------------------------

    def block_table(self, request_ids: list[int]) -> np.ndarray:
        """[R, B] every request's blocks, padded with 0 (B: the most any holds; a request the
        cache does not hold has none)."""
        tables = [self._tables.get(rid, ()) for rid in request_ids]
        out = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int64)
        for row, table in zip(out, tables, strict=True):
            row[:len(table)] = table
        return out

    def slot_rows(self, request_ids: list[int], ends: np.ndarray, width: int) -> np.ndarray:
        """[R, width] slot of positions 0 .. width - 1 of each request, 0 at and past its `ends`
        (every request's keys side by side: one numpy expression, not a loop of tensor ops)."""
        return self.rows_of(self.block_table(request_ids), ends, width)

    def slots_between(self, request_ids: list[int], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Flat slots of positions starts[i] .. ends[i] - 1 of each request, in request order."""
        return self.between_of(self.block_table(request_ids), starts, ends)

    def rows_of(self, table: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
        """`slot_rows` of the requests whose `block_table` this is (one table for a step's calls)."""
        bs = self.spec.block_size
        if table.shape[1] * bs < width:  # positions past every request's blocks: slot 0, masked
            table = np.pad(table, ((0, 0), (0, -(-width // bs) - table.shape[1])))
        pos = np.arange(width)
        slots = table[:, pos // bs] * bs + pos % bs
        slots[pos[None, :] >= np.asarray(ends)[:, None]] = 0
        return slots

    def between_of(self, table: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """`slots_between` of the requests whose `block_table` this is."""
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        counts = ends - starts
        if not counts.sum():
            return np.zeros(0, dtype=np.int64)
        bs = self.spec.block_size
        rows = np.repeat(np.arange(len(counts)), counts)
        first = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        pos = np.arange(first[-1]) - np.repeat(first[:-1] - starts, counts)
        return table[rows, pos // bs] * bs + pos % bs

    def slots(self, rid: int, start: int, end: int) -> torch.Tensor:
        """Slot index of positions start..end-1 of request rid: [end - start], on the host (the
        caller sends a step's indices to the device in one copy)."""
        bs = self.spec.block_size
        table = torch.tensor(self._tables[rid], dtype=torch.long, device="cpu")
        pos = torch.arange(start, end, device="cpu")
        return table[pos // bs] * bs + pos % bs


def gather(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`table[slots]` for an index of any shape into the first dimension of one layer's keys or
    values, as one `index_select`: advanced indexing took 2–4 × as long on a CPU (one request's
    161 slots 18 → 8 µs; 64 requests × 300 slots 2.2 → 0.54 ms; docs/target.md)."""
    return table.index_select(0, slots.reshape(-1)).view(*slots.shape, *table.shape[1:])


def scatter(table: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`table[slots] = rows` in place (slots 1-D, distinct but for a graph's scratch slot)."""
    table.index_copy_(0, slots, rows.to(table.dtype))
