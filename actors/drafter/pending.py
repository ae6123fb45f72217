"""Context held back from the drafter kinds that are not drafting for a request.

A replica hosting several kinds (block, MTP, n-gram) must let any of them draft for a request
next step, so each needs the request's context: tokens, and the target's features. Giving it to
every kind at once costs every kind's catch-up pass on every token (the MTP module and the
block drafter each run a layer over it), though a request mostly settles on one kind. So each
kind's share waits here until that kind drafts for the request (`flush`), or until it exceeds
`limit` tokens (then it is committed anyway: memory stays bounded by kinds × requests × limit
rows of the features that kind reads). A short request that never drafts with a kind never pays
for it.
"""

from __future__ import annotations

from actors.drafter.base import cat_rows


class PendingContext:
    def __init__(self, drafters: list, limit_tokens: int) -> None:
        self.drafters, self.limit = drafters, limit_tokens
        self.layers = [tuple(getattr(d, "target_layers", ())) for d in drafters]  # what each kind reads
        self.chunks: list[dict[int, list[tuple[list[int], dict]]]] = [{} for _ in drafters]
        self.sizes: list[dict[int, int]] = [{} for _ in drafters]

    def add(self, rids: list[int], tokens: list[list[int]], features: list[dict]) -> None:
        """Committed context of these requests (as `Drafter.commit` takes it), held per kind."""
        over: list[list[int]] = [[] for _ in self.drafters]
        for rid, toks, h in zip(rids, tokens, features, strict=True):
            for k, layers in enumerate(self.layers):
                self.chunks[k].setdefault(rid, []).append((list(toks), {lay: h[lay] for lay in layers if lay in h}))
                self.sizes[k][rid] = self.sizes[k].get(rid, 0) + len(toks)
                if self.sizes[k][rid] > self.limit:
                    over[k].append(rid)
        for k, full in enumerate(over):
            self.flush(k, full)

    def flush(self, kind: int, rids: list[int]) -> int:
        """Give kind `kind` everything held for these requests (one commit call, in order);
        returns the tokens given."""
        rids = [rid for rid in dict.fromkeys(rids) if rid in self.chunks[kind]]
        if not rids:
            return 0
        tokens, features = [], []
        for rid in rids:
            chunks = self.chunks[kind].pop(rid)
            del self.sizes[kind][rid]
            tokens.append([t for toks, _ in chunks for t in toks])
            rows = [h for _, h in chunks if h]
            features.append({lay: cat_rows([h[lay] for h in rows]) for lay in rows[0]} if rows else {})
        self.drafters[kind].commit(rids, tokens, features)
        return sum(map(len, tokens))

    def held(self, kind: int, rid: int) -> int:
        return self.sizes[kind].get(rid, 0)

    def held_requests(self) -> set[int]:
        return {rid for chunks in self.chunks for rid in chunks}

    def release(self, rids: list[int]) -> None:
        for chunks, sizes in zip(self.chunks, self.sizes, strict=True):
            for rid in rids:
                chunks.pop(rid, None)
                sizes.pop(rid, None)
