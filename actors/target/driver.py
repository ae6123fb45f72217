"""`DriverGroup`: EP N driven from the caller's process (DESIGN.md, "Where the step runs").

Rank 0 is a `TargetRank` in this process; ranks 1 .. N-1 are Ray actors whose one long-lived call
is `TargetRank.serve`. Every call is a message over the unit's control group (`link.RankLink`)
and an `Answer` read back in order; Ray only starts, places and kills the ranks.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.inprocess import InProcess, Pending
from actors.target import wire
from actors.target.gpu import local_rank_device, release_gpu
from actors.target.group import EPConfig, EPGroup, EPGroupError, rank_spec
from actors.target.worker import BatchRejected, TargetRank, TargetWorker


class DriverGroup(EPGroup):
    """EP N driven from this process (DESIGN.md, "Where the step runs"): rank 0 is a `TargetRank`
    here, ranks 1 .. N-1 are Ray actors running `TargetRank.serve`. A call is a message to each
    other rank over the unit's control group (`link.RankLink`), rank 0's own part done here
    meanwhile, then their answers; Ray only starts, places and kills the ranks. A rank that dies
    closes its sockets and the call in flight fails at once; one that hangs fails the collective
    after `group_timeout_s`, and so does the wait for its answer: rank 0 waits for answers once its
    own part of the call is done, and a peer that far behind would have held up rank 0's
    collectives as long (one stopped after the step's last collective, before answering, used to
    cost the whole `step_timeout_s`)."""

    def __init__(self, cfg: EPConfig) -> None:
        if cfg.world < 2:
            raise ValueError("a driver group has two ranks or more (EP 1: InProcessGroup)")
        self._sent = [0] * cfg.world  # calls that want an answer, per rank
        self._answered = [0] * cfg.world
        self._answers: list[dict[int, tuple[bool, object]]] = [{} for _ in range(cfg.world)]
        self._loops: list = []
        super().__init__(cfg)

    def _start(self, cfg: EPConfig) -> list:
        self.pg, self._owns_pg = self._reserve(cfg)
        try:
            device, self._gpu_holder = local_rank_device(cfg.gpus_per_rank, self.pg, cfg.bundle_offset,
                                                         cfg.start_timeout_s)
        except Exception as exc:
            if self._owns_pg:
                remove_placement_group(self.pg)
            raise EPGroupError(f"rank 0 got no GPU: {type(exc).__name__}: {exc}") from exc
        self.local = TargetRank(rank_spec(cfg, 0, device), cfg.guests)
        remote = [TargetWorker.options(num_cpus=cfg.cpus_per_rank, num_gpus=cfg.gpus_per_rank, max_concurrency=2,
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           self.pg, placement_group_bundle_index=cfg.bundle_offset + r)
                                       ).remote(rank_spec(cfg, r), cfg.guests)
                  for r in range(1, cfg.world)]
        return [InProcess(self.local), *remote]

    @staticmethod
    def _bundles(cfg: EPConfig) -> list[dict[str, float]]:
        """Rank 0 runs here: an own group's bundle 0 stands for this process (a token of a
        resource every node has, on this node: `_selectors`) and holds rank 0's GPU when ranks
        have GPUs (`gpu.local_rank_device` takes it from there), so STRICT_SPREAD puts the other
        ranks on other nodes and no other rank is given rank 0's GPU; bundles 1 .. N-1 hold ranks
        1 .. N-1."""
        here = {f"node:{ray.util.get_node_ip_address()}": 0.001} | (
            {"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})
        return [here, *EPGroup._bundles(cfg)[1:]]

    @staticmethod
    def _selectors(cfg: EPConfig) -> list[dict[str, str]]:
        """Bundle 0 on this very node (its IP alone is ambiguous where nodes share one host)."""
        return [{NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()}] + [{}] * (cfg.world - 1)

    def _setup(self) -> list[dict]:
        master = self.local.master_address()
        refs = [w.setup.remote(master) for w in self.workers[1:]]  # they join while rank 0 does
        try:
            mine = self.local.setup(master)
            others = ray.get(refs, timeout=self.cfg.start_timeout_s)
        except Exception as exc:
            self._fail(f"the ranks did not start: {type(exc).__name__}: {str(exc).splitlines()[0]}", exc)
        self.link = self.local.link
        self._loops = [w.serve.remote() for w in self.workers[1:]]
        return [mine, *others]

    # -- calls --------------------------------------------------------------------------------

    def call(self, rank: int, part: str, method: str, args: tuple, answer: bool = True) -> Answer | None:
        """Send `part.method(*args)` to rank (≥ 1); its `Answer` when one is wanted."""
        if self._broken:
            raise EPGroupError(f"EP group is down: {self._broken}")
        try:
            self.link.send(rank, wire.call(part, method, args, answer))
        except RuntimeError as exc:
            self._fail(f"rank failed: rank {rank}: {str(exc).splitlines()[0]}", exc)
        if not answer:
            return None
        self._sent[rank] += 1
        return Answer(self, rank, self._sent[rank] - 1)

    def part(self, rank: int, name: str, one_way: frozenset[str] = frozenset()):
        """A handle on guest `name` of `rank`, with actor-call syntax (`h.m.remote(*a)`); methods in
        `one_way` are sent without waiting for an answer (their failures are logged by the rank)."""
        return InProcess(self.local.parts[name]) if rank == 0 else RemotePart(self, rank, name, one_way)

    def result(self, rank: int, seq: int) -> tuple[bool, object]:
        """(ok, value) of the `seq`-th answered call to `rank`; answers arrive in order, earlier
        ones are kept for their own `Answer`."""
        while seq not in self._answers[rank]:
            try:
                got = wire.read_reply(self.link.recv(rank, min(self.cfg.step_timeout_s, self.cfg.group_timeout_s)))
            except (RuntimeError, wire.WireError) as exc:  # gone, hung, or not speaking this link
                self._fail(f"rank failed: rank {rank}: {str(exc).splitlines()[0]}", exc)
            self._answers[rank][self._answered[rank]] = got
            self._answered[rank] += 1
        return self._answers[rank].pop(seq)

    def _each(self, method: str, args: list[tuple | None], answer: bool = True) -> list:
        if self._broken:
            raise EPGroupError(f"EP group is down: {self._broken}")
        pending = [(r, self.call(r, "target", method, a, answer)) for r, a in enumerate(args)
                   if r > 0 and a is not None]
        outcomes = []
        if args[0] is not None:
            try:
                outcomes.append((True, getattr(self.local, method)(*args[0])))
            except BatchRejected as exc:
                outcomes.append((False, exc))
            except Exception as exc:
                self._fail(f"rank failed: rank 0: {type(exc).__name__}: {str(exc).splitlines()[0]}", exc)
        if not answer:
            return []
        outcomes += [self.result(r, ans.seq) for r, ans in pending]
        rejected = [str(v) for ok, v in outcomes if not ok and isinstance(v, BatchRejected)]
        failed = [v for ok, v in outcomes if not ok and not isinstance(v, BatchRejected)]
        if failed:
            self._fail(f"rank failed: {type(failed[0]).__name__}: {str(failed[0]).splitlines()[0]}", failed[0])
        if rejected:
            specific = [m for m in rejected if "another rank" not in m]
            raise BatchRejected((specific or rejected)[0])
        return [v for _, v in outcomes]

    def features(self, spans: dict[int, tuple[int, int]]) -> list:
        per_rank: list[dict[int, tuple[int, int]]] = [{} for _ in range(self.cfg.world)]
        for rid, span in spans.items():
            per_rank[self._owner[rid]][rid] = span
        return [self.local.take_features(p) if r == 0 else self.call(r, "target", "take_features", (p,))
                for r, p in enumerate(per_rank) if p]

    def shutdown(self) -> None:
        for w in self.workers[1:]:
            ray.kill(w, no_restart=True)
        self.workers, self._loops, self.link = [], [], None
        self.local.close()  # this process leaves the unit's groups and frees rank 0's memory
        release_gpu(self._gpu_holder)
        self._gpu_holder = None
        if self._owns_pg:
            remove_placement_group(self.pg)
            self._owns_pg = False


class Answer(Pending):
    """The answer a rank owes the driver for one call (see `DriverGroup.result`)."""

    __slots__ = ("group", "rank", "seq")

    def __init__(self, group: DriverGroup, rank: int, seq: int) -> None:
        self.group, self.rank, self.seq = group, rank, seq

    def get(self):
        ok, value = self.group.result(self.rank, self.seq)
        if not ok:
            raise value
        return value


class RemotePart:
    """A guest on another rank, with actor-call syntax: `part.method.remote(*args)` sends it."""

    def __init__(self, group: DriverGroup, rank: int, name: str, one_way: frozenset[str]) -> None:
        self.group, self.rank, self.name, self.one_way = group, rank, name, one_way

    def __getattr__(self, method: str):
        group, rank, name, answer = self.group, self.rank, self.name, method not in self.one_way

        class _Call:
            @staticmethod
            def remote(*args):
                return group.call(rank, name, method, args, answer)

        return _Call
