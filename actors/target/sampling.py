"""The target's distribution for each verified row, with a request's sampling controls applied
before verification — so speculative decoding stays exact with them: greedy takes the argmax of
the adjusted logits, sampling draws from the adjusted distribution, and a draft is accepted
against that distribution like any other.

Order (as vLLM applies them): logit bias and the `min_tokens` ban, then the repetition,
frequency and presence penalties, then temperature, top-k, top-p and min-p.
Penalties count the tokens a row's position has seen: the committed ones *and* the drafts
before it in the same chunk (row j of [last, d1 .. dk] is the distribution after d1 .. dj, as
in plain decoding once those are accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Controls:
    """One request's sampling controls (neutral values change nothing)."""

    presence_penalty: float = 0.0  # subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits divided, negative multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # `banned` tokens (EOS, stop token ids) are masked until the output is this long
    banned: tuple[int, ...] = ()
    top_k: int = 0  # sampling: keep the k most likely tokens (0: all)
    min_p: float = 0.0  # sampling: keep tokens at least min_p × the most likely one's probability

    @property
    def changes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.banned))


NEUTRAL = Controls()


@dataclass(frozen=True)
class RequestControls:
    """A request's controls for one step, with what the rank needs to count its tokens."""

    controls: Controls
    history: np.ndarray  # token ids in the KV cache before this step's chunk
    prompt_len: int  # the first prompt_len positions are prompt, the rest output
    allowed: np.ndarray | None = None  # [m, ceil(V / 32)] int32 bitmasks of the tokens a grammar allows per row


def apply_controls(logits: torch.Tensor, chunk: np.ndarray, rows: np.ndarray, rc: RequestControls) -> torch.Tensor:
    """Adjusted logits [m, V] of one request's rows: logits [m, V] at chunk positions `rows` [m]
    (row j follows history + chunk[:rows[j] + 1])."""
    c, vocab = rc.controls, logits.shape[-1]
    out = logits.float().clone()
    rows = np.asarray(rows, dtype=np.int64)
    if rc.allowed is not None:  # a grammar's mask comes first: nothing else can bring a forbidden token back
        bits = np.unpackbits(np.ascontiguousarray(rc.allowed).view(np.uint8), axis=-1, bitorder="little")
        out[torch.from_numpy(~bits[:, :vocab].astype(bool)).to(out.device)] = float("-inf")
    if c.logit_bias:
        ids, bias = zip(*c.logit_bias, strict=True)
        out[:, list(ids)] += torch.tensor(bias, dtype=out.dtype, device=out.device)
    start = len(rc.history)  # absolute position of chunk[0]
    if c.min_tokens and c.banned:
        produced = start + rows + 1 - rc.prompt_len  # output tokens before the token this row draws
        early = torch.from_numpy(produced < c.min_tokens).to(out.device)
        if bool(early.any()):
            ban = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            ban[list(c.banned)] = True
            out[early[:, None] & ban[None, :]] = float("-inf")
    if c.presence_penalty or c.frequency_penalty or c.repetition_penalty != 1.0:
        history = np.asarray(rc.history, dtype=np.int64)
        seen = np.repeat(np.bincount(history, minlength=vocab)[None, :], len(rows), axis=0)  # [m, V]
        output = np.repeat(np.bincount(history[rc.prompt_len:], minlength=vocab)[None, :], len(rows), axis=0)
        j, q = np.nonzero(rows[:, None] >= np.arange(len(chunk))[None, :])  # row j has seen chunk[q]
        tok = np.asarray(chunk, dtype=np.int64)[q]
        np.add.at(seen, (j, tok), 1)
        mine = start + q >= rc.prompt_len  # chunk tokens past the prompt are output
        np.add.at(output, (j[mine], tok[mine]), 1)
        counts = torch.from_numpy(output.astype(np.float32)).to(out.device)
        if c.repetition_penalty != 1.0:
            hit = torch.from_numpy(seen > 0).to(out.device)
            r = c.repetition_penalty
            out = torch.where(hit, torch.where(out > 0, out / r, out * r), out)
        out = out - c.frequency_penalty * counts - c.presence_penalty * (counts > 0).float()
    return out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of probs [M, V] at its uniform u [M] — the smallest whose cumulative
    probability exceeds u × the row's mass — on probs' device, in float64: the arithmetic of
    `dcut_core.rules.inverse_cdf`, so a rank hands back one token a row, not a distribution."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    return torch.clamp_max((cdf <= (u.double() * cdf[:, -1])[:, None]).sum(-1), probs.shape[-1] - 1)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities [M, V] for logits [M, V] with per-row temperature [M] (> 0), top_p [M], and
    optionally top_k [M] (0: off) and min_p [M] (0: off).

    Top-k keeps the k most likely tokens (ties at the k-th all kept); top-p the smallest set of
    most likely tokens whose mass reaches top_p (at least one); min-p the tokens with at least
    min_p × the most likely one's probability. Then renormalised: the distribution speculative
    sampling must reproduce.
    """
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if top_k is not None and bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1])).clamp_max(probs.shape[-1])
        kth = torch.sort(probs, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None].long())
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    if bool((top_p < 1.0).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop = before >= top_p[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if min_p is not None and bool((min_p > 0).any()):
        floor = min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
