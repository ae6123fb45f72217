"""The engine's configuration (plain, frozen; pydantic lives at the edge in deployments/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.engine.placement import COORDINATOR_CPUS, UnitLayout
from actors.engine.replica import DrafterSpec
from actors.target.group import EPConfig
from dcut_core.planning import DraftPlanner


@dataclass(frozen=True)
class EngineConfig:
    target_dir: str
    tokenizer_path: str | None = None
    drafter: str = "block"  # "block", "mtp", "eagle3" or "ngram", or several ("block,mtp,ngram"): chosen per request
    drafter_dir: str | None = None  # the weights of a single kind
    block: int = 16
    policy: str = "dcut"
    ep: int = 1
    drafters: int = 1
    max_running: int = 64
    kv_capacity_tokens: int = 65536  # per rank, on the CPU; a GPU rank sizes its cache from its free memory
    dtype: str = "auto"  # what the ranks compute in: the checkpoint's dtype on GPUs, float32 on the CPU
    cuda_graphs: str = "auto"  # decode/verify steps as CUDA graphs where they can be (actors/target/graphs.py)
    gpu_memory_utilization: float = 0.9  # share of each rank's GPU its weights and KV cache may take
    prefill_chunk: int = 512  # prompt tokens per request per step
    prefill_budget: int = 2048  # prompt tokens per step in all, riding in the step's one forward
    threads_per_rank: int = 1
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0  # > 0: ranks on GPUs, nccl (untested here: no GPU on this machine)
    group_timeout_s: float = 30.0  # a collective waiting this long on a rank (stalled, cut off) fails the step,
    # and the unit rebuilds its EP group in place: keep it below the replica's stall timeout
    cpus_per_drafter: float = 0.5
    ep_placement: str = "PACK"  # the EP group's own placement group: PACK, or STRICT_SPREAD (a rank per node)
    eos_token_id: int | None = None
    cost_model_cache: str | None = None
    drafting_gate: bool = True
    explore_every: int = 50  # a step in this many that the gate rates not worth drafting drafts anyway,
    explore_requests: int = 4  # for this many requests, so the gate keeps learning;
    explore_warmup: int = 64  # and every such step until this many verifications were observed
    # Finished requests' outputs the n-gram kind drafts from where a request's own text has no match
    # (`actors/drafter/ngram.py`'s `Corpus`, ~0.5 KB a token); 0: off.
    ngram_corpus_tokens: int = 1 << 16
    drafter_backlog_tokens: int = 512  # context held back per request until it drafts (lazy upkeep)
    # (requests, block): above this many decoding requests a request drafts within this shorter block
    # (None: `block` at every load).
    load_block: tuple[int, int] | None = None
    draft_slack: int = 2  # positions drafted past the gate's plan, for pruning to judge
    draft_extend: bool = True  # and every further position that pays for its own drafting (pruning judges)
    # A chained kind (MTP) cut pass by pass on its calibrated confidences (dcut_core/chains.py). Off: on this
    # machine its per-pass confidences cost more than the cut saves (docs/benchmarks.md, session 24).
    chain_stop: bool = False
    guard_threshold: float = 0.02
    max_budget: int | None = None
    # Plain decoding measured beside the gate's steps, load band by load band, and played where it
    # delivers more (dcut_core/payoff.py): the gate's predictions can be priced wrong.
    payoff_check: bool = True
    # ... and, with several kinds, the gate over each kind alone beside the gate over all of them.
    payoff_kind_arms: bool = True
    step_log: str | None = None  # msgpack file of every step's drafts and decisions
    # The estimators learn from a step on a thread while the next step's forward runs. None: on when
    # the ranks are on GPUs (there the forward waits on the device); on this machine's CPU ranks torch
    # keeps every core busy and the learner only contends with it (docs/benchmarks.md, session 21).
    overlap: bool | None = None
    unit_placement: bool = False  # True: run inside the unit's placement group (Serve), ranks and
    # drafters pinned to its bundles (actors/engine/placement.py); False: the EP group reserves its own
    coordinator_cpus: float = COORDINATOR_CPUS
    in_process: bool = True  # the coordinator's process is EP rank 0 and drives the others over the unit's
    # control group; each rank hosts a drafter replica (at EP 1 a step is function calls). False: every rank
    # and `drafters` drafter replicas are Ray actors, called per step (fault tests of a lone drafter's death)
    drafter_dirs: tuple[tuple[str, str], ...] = ()  # (kind, weights folder) of each kind hosted beside others
    # The end of start-up freezes this process's heap out of the cyclic collector's full scans
    # (actors/heap.py: a full collection of the start-up heap stalls the step loop for ~0.1 s).
    freeze_heap: bool = True

    @property
    def learns_behind(self) -> bool:
        """Whether a step is learnt while the next one's forward runs (`overlap` resolved)."""
        return self.overlap if self.overlap is not None else self.gpus_per_rank > 0

    def __post_init__(self) -> None:
        if self.gpus_per_rank and self.ep > 1 and self.gpus_per_rank != int(self.gpus_per_rank):
            # Two ranks sharing one GPU: NCCL refuses a group whose ranks hold the same device.
            raise ValueError(f"gpus_per_rank must be a whole number of GPUs at EP > 1 (got {self.gpus_per_rank}): "
                             "NCCL cannot run two ranks of one group on one GPU")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The drafter kinds every replica hosts (in the order the per-kind state is indexed)."""
        return tuple(self.drafter.split(","))

    @property
    def replica_kinds(self) -> tuple[str, ...]:
        """The kinds the drafter replicas host: all but n-gram, which the coordinator drafts itself
        (actors/engine/lookahead.py). Empty: the engine has no drafter replica."""
        from actors.drafter.kinds import REGISTRY

        return tuple(k for k in self.kinds if not REGISTRY[k].local)

    @property
    def drafts(self) -> bool:
        """The configured policy uses drafts (an `ar`-only engine starts no drafter)."""
        from dcut_core.pruning import policy_from_name

        return policy_from_name(self.policy, self.block).drafts

    def layout(self) -> UnitLayout:
        drafters = (self.ep if self.in_process else self.drafters) if self.drafts and self.replica_kinds else 0
        return UnitLayout(self.ep, drafters, self.coordinator_cpus, self.cpus_per_rank, self.gpus_per_rank,
                          self.cpus_per_drafter, self.in_process)

    def ep_config(self, placement_group=None, guests: tuple = ()) -> EPConfig:
        """The target's part: its EP group (in the unit's placement group when given one), with
        `guests` built beside every rank."""
        return EPConfig(self.target_dir, world=self.ep, placement=self.ep_placement, cpus_per_rank=self.cpus_per_rank,
                        group_timeout_s=self.group_timeout_s,
                        gpus_per_rank=self.gpus_per_rank, threads_per_rank=self.threads_per_rank,
                        kv_capacity_tokens=self.kv_capacity_tokens, dtype=self.dtype, cuda_graphs=self.cuda_graphs,
                        graph_warmup_requests=self.max_running,
                        gpu_memory_utilization=self.gpu_memory_utilization, placement_group=placement_group,
                        bundle_offset=self.layout().rank_bundle(0) if placement_group is not None else 0,
                        guests=guests)

    def drafter_spec(self) -> DrafterSpec:
        """The drafter replicas' part (the kinds they host: `replica_kinds`)."""
        return DrafterSpec(",".join(self.replica_kinds), self.target_dir, self.drafter_dir, self.block,
                           self.threads_per_rank, dirs=self.drafter_dirs)

    def planner(self) -> DraftPlanner:
        """How the drafting gate shapes its plan (budget, slack, extension)."""
        return DraftPlanner(self.max_budget, self.draft_slack, self.draft_extend)

    def dcut_options(self, policy: str) -> dict:
        """The options of `policy` that this config sets (only `dcut` takes any)."""
        return {"guard_threshold": self.guard_threshold, "max_budget": self.max_budget} if policy == "dcut" else {}

    def detokenizer(self) -> Callable[[list[int]], str]:
        if self.tokenizer_path is None:
            return lambda ids: " ".join(map(str, ids))
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.tokenizer_path)
        return lambda ids: tok.decode(ids, skip_special_tokens=True)
