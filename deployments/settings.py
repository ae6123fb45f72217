"""Typed settings of the served app (pydantic, at the edge), and the one place that reads
environment variables. Inside, the engine receives a plain frozen `EngineConfig`."""

from __future__ import annotations

import os
import pathlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.drafter import KINDS
from deployments.bundle import BUNDLED, Bundle

ENV_PREFIX = "DCUT_"
BLOCK = 8  # a drafter kind's default block
# The n-gram kind's: 16 while one request decodes alone, 8 above. It accepts all 7 drafts of a
# block of 8 at a third of positions, and at one request a drafted token costs little beside the
# step's weights; at 16-64 requests rows of 15 lost 3-8 %, and with 16 up to two or five requests
# C = 4 read 0.97-1.00 x block 8 end to end (docs/benchmarks.md, sessions 50-51).
NGRAM_BLOCK, NGRAM_LOAD_BLOCK = 16, (1, 8)


class ServeSettings(BaseModel):
    """Everything `dcut serve`, `serve run` and `serve deploy` can set."""

    model_config = ConfigDict(extra="forbid")

    model_root: str = Field(str(BUNDLED), description="bundle folder: target/, drafter/, tokenizer.json")
    model_name: str = "dcut-demo"
    # The serving default is what won end to end on held-out prompts and in the trace simulator
    # (docs/benchmarks.md, "Which configuration serves by default"): n-gram lookup, block 16 while
    # one request decodes alone and 8 above (`block` and `load_block` left unset; session 51).
    drafter: str = Field("ngram", description="block, mtp, eagle3 or ngram; several (block,mtp), chosen per "
                                              "request; auto: every kind the bundle holds; tuned: the "
                                              "kinds its prior names for per-request choice (dcut prior)")
    policy: str = "dcut"
    block: int | None = Field(None, ge=2, le=16, description="drafts a request may verify per step, plus one; "
                              "unset: 16 for the n-gram kind alone (with load_block (1, 8)), else 8")
    load_block: tuple[int, int] | None = Field(
        None, description="(requests, block): above this many decoding requests a request drafts within this "
                          "shorter block (null: block at every load); unset with block: the kind's default")
    ep: int = Field(1, ge=1)
    drafters: int = Field(1, ge=1, description="drafter replica actors (in_process=False; otherwise one per rank)")
    in_process: bool = Field(True, description="the engine replica's process is EP rank 0 and drives the other "
                                               "ranks over the unit's own process group; each rank hosts a "
                                               "drafter (EP 1: a step is function calls). False: ranks and "
                                               "`drafters` drafter replicas are Ray actors called every step")
    max_running: int = Field(64, ge=1)
    max_waiting: int = Field(256, ge=0, description="queued requests beyond max_running before 429")
    kv_capacity_tokens: int = Field(65536, ge=256, description="KV tokens per rank on the CPU (a GPU rank sizes its "
                                    "cache from its free memory: gpu_memory_utilization)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="what the ranks compute in: auto is the checkpoint's dtype on GPUs, float32 on the CPU")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of each rank's GPU memory its "
                                          "weights and KV cache may take")
    cuda_graphs: Literal["auto", "off", "padded"] = Field(
        "auto", description="decode and verify steps replayed as CUDA graphs where nothing in them waits for the host "
        "(one rank, bfloat16 grouped experts); padded: the same padded steps, not captured (tests)")
    max_prompt_tokens: int = Field(1536, ge=1)
    max_tokens_limit: int = Field(512, ge=1)
    max_stop: int = Field(4, ge=0)
    max_choices: int = Field(16, ge=1, description="prompts × max(n, best_of) one request may ask for")
    max_body_bytes: int = Field(1_000_000, ge=1024)
    api_key: str | None = Field(None, description="bearer token required on /v1/* when set")
    ngram_corpus_tokens: int = Field(1 << 16, ge=0, description="finished requests' output tokens the n-gram "
                                     "drafter drafts from where a request's own text has no match (0: off; "
                                     "a timing side channel between tenants: docs/security.md)")
    guard_threshold: float = Field(0.02, ge=0)
    max_budget: int | None = Field(None, ge=1)
    payoff_check: bool = Field(True, description="measure plain decoding beside the drafting gate's steps, load "
                               "band by load band, and decode plainly where it delivers more (dcut_core/payoff.py)")
    threads_per_rank: int | None = Field(None, ge=1, description="torch threads per rank (default: cores / EP)")
    cpus_per_rank: float | None = Field(None, gt=0, description="CPUs reserved per rank (default: min(1, cores / EP))")
    cpus_per_drafter: float = Field(0.5, gt=0)
    gpus_per_rank: float = Field(0.0, ge=0, description="> 0 puts EP ranks on GPUs (nccl)")
    unit_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement strategy of the engine unit's bundles (PACK spills to more nodes)")
    cost_model_cache: str = "runs/cache"
    stall_timeout_s: float = Field(60.0, gt=0, description="the engine replica reports unhealthy when work has "
                                                          "waited this long without a step finishing")
    group_timeout_s: float = Field(30.0, gt=0, description="a collective waiting this long on an EP rank fails "
                                   "the step and the unit rebuilds its group in place; keep it below stall_timeout_s")
    health_check_period_s: float = Field(5.0, gt=0, description="how often Serve checks each engine replica")
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0, description="how long a replica being replaced may "
                                                                      "finish its requests")
    ingress_replicas: int = Field(1, ge=1)
    engine_autoscaling: dict | None = Field(None, description="Serve autoscaling_config of the engine unit "
                                                              "(a serve config YAML can set it too)")

    @field_validator("load_block", mode="before")
    @classmethod
    def _load_block_text(cls, v):
        """An environment variable's text: "2,8" (or "" / "none": off)."""
        if isinstance(v, str):
            return None if v.strip().lower() in ("", "none", "null") else tuple(v.split(","))
        return v

    @model_validator(mode="after")
    def _check(self) -> ServeSettings:
        from dcut_core.pruning import policy_from_name

        if self.block is None:  # the kind's default: the n-gram kind's drafts cost ~nothing to make
            ngram = self.drafter == "ngram"
            self.block = NGRAM_BLOCK if ngram else BLOCK
            if ngram and "load_block" not in self.model_fields_set:
                self.load_block = NGRAM_LOAD_BLOCK
        policy_from_name(self.policy, self.block)  # raises ValueError on an unknown policy
        if self.load_block is not None and not (self.load_block[0] >= 1 and self.load_block[1] >= 2):
            raise ValueError(f"load_block is (requests >= 1, block >= 2), not {self.load_block}")
        kinds = self.drafter.split(",")
        if self.drafter not in ("auto", "tuned") and (not set(kinds) <= set(KINDS) or len(set(kinds)) != len(kinds)):
            raise ValueError(f"drafter must be auto, tuned, or one or more of {', '.join(KINDS)} (comma-separated, "
                             f"each once), not {self.drafter!r}")
        return self

    @classmethod
    def from_env(cls, **overrides) -> ServeSettings:
        """DCUT_<FIELD> environment variables, then explicit overrides."""
        env = {}
        for name in cls.model_fields:
            raw = os.environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                env[name] = raw
        return cls(**(env | {k: v for k, v in overrides.items() if v is not None}))

    def resolved(self) -> ServeSettings:
        """Defaults that depend on the machine filled in once, where the app is built, so the
        reserved bundles and the engine inside them agree on every node."""
        from actors.engine.placement import rank_resources

        threads, cpus = rank_resources(self.ep)
        return self.model_copy(update={"threads_per_rank": self.threads_per_rank or threads,
                                       "cpus_per_rank": self.cpus_per_rank or cpus})

    def engine_config(self, unit_placement: bool = False):
        """The one engine config every command builds its engine from (serve, generate, bench)."""
        from actors.engine.config import EngineConfig
        from dcut_core.pruning import policy_from_name

        bundle = Bundle(pathlib.Path(self.model_root))
        bundle.check(self.drafter if policy_from_name(self.policy, self.block).drafts else None)
        s = self.resolved()
        kinds = bundle.kinds(s.drafter)
        return EngineConfig(
            bundle.target, bundle.tokenizer, ",".join(kinds), bundle.drafter_dir(kinds[0]), s.block, s.policy, ep=s.ep,
            drafter_dirs=tuple((k, bundle.drafter_dir(k)) for k in kinds if bundle.drafter_dir(k)),
            drafters=s.drafters, max_running=s.max_running, kv_capacity_tokens=s.kv_capacity_tokens, dtype=s.dtype,
            gpu_memory_utilization=s.gpu_memory_utilization, cuda_graphs=s.cuda_graphs,
            threads_per_rank=s.threads_per_rank, cpus_per_rank=s.cpus_per_rank, gpus_per_rank=s.gpus_per_rank,
            cpus_per_drafter=s.cpus_per_drafter, eos_token_id=bundle.eos_token_id(),
            cost_model_cache=s.cost_model_cache, guard_threshold=s.guard_threshold, max_budget=s.max_budget,
            ngram_corpus_tokens=s.ngram_corpus_tokens, payoff_check=s.payoff_check, load_block=s.load_block,
            unit_placement=unit_placement, in_process=s.in_process, group_timeout_s=s.group_timeout_s,
        )

    def local_cpus(self) -> int:
        """CPUs to declare for a local Ray that runs one engine unit of these settings: the
        machine's cores plus a slot per rank and drafter, so reservations (fractions of a CPU,
        which Ray does not enforce) never keep a unit from starting."""
        return max(4, (os.cpu_count() or 1) + self.ep + self.drafters)

    def unit_layout(self):
        """The engine unit's bundles (one placement group per engine replica)."""
        return self.engine_config().layout()
