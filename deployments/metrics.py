"""Prometheus metrics of the served app (text format at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Metrics:
    """One registry per ingress replica (no process-global state)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._requests = Counter("dcut_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                 registry=r)
        self._tokens = Counter("dcut_generated_tokens", "completion tokens sent", registry=r)
        self._ttft = Histogram("dcut_ttft_seconds", "time to first token (streams)", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self._tpot = Histogram("dcut_tpot_seconds", "time per output token (streams)", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self._engine = {
            name: Gauge(f"dcut_engine_{name}", doc, registry=r) for name, doc in (
                ("mat", "mean accepted tokens per step per request, bonus included (last 200 steps)"),
                ("keep_ratio", "kept / drafted drafts (last 200 steps)"),
                ("cost_model_error", "median |predicted - measured| / measured verify time"),
                ("predicted_verify_s", "mean predicted verify time"),
                ("measured_verify_s", "mean measured verify time"),
                ("in_flight", "requests in the engine (running + waiting)"),
                ("steps", "decode steps since start"),
                ("drafter_replicas_lost", "drafter replicas that died (their requests finished without drafts)"),
                ("drafter_context_lost", "drafting calls whose context could not be fetched from the target's "
                                         "ranks (those requests went on without drafts)"),
                ("ep_group_rebuilds", "times the EP target group was rebuilt after a rank died"),
                ("verify_tokens_per_step", "mean tokens verified per step: requests plus kept drafts (last 200 "
                                           "steps)"),
                ("running", "requests decoding or prefilling in the engine"),
                ("waiting", "requests queued in the engine, not yet admitted"),
                ("gc_collections", "the engine process's garbage collections since start (they stop the step loop)"),
                ("gc_full_collections", "of them full (generation 2): they scan every unfrozen object"),
                ("gc_pause_s", "seconds the engine process spent in garbage collection since start"),
                ("gc_longest_pause_s", "the engine process's longest garbage-collection pause since start"),
                ("gc_frozen_objects", "objects frozen out of the collector's scans at the end of start-up"),
                ("graph_captures", "CUDA graphs the ranks captured since start (each stalls its step; most are "
                                   "captured at the first step)"),
            )
        }
        self._ranks = Gauge("dcut_engine_rank_step_seconds", "mean own forward time per step of each EP rank "
                            "(last 200 steps)", ["rank"], registry=r)
        self._gpu = {
            name: Gauge(f"dcut_gpu_{name}", doc, ["gpu", "name"], registry=r) for name, doc in (
                ("memory_used_bytes", "GPU memory in use (NVML), per GPU of the engine's node"),
                ("memory_total_bytes", "GPU memory (NVML), per GPU of the engine's node"),
                ("utilization_ratio", "share of the last NVML sample period a kernel ran, per GPU of the engine's "
                                      "node"),
            )
        }

        self._kinds = Gauge("dcut_engine_drafter_drafts", "since start, per drafter kind: requests it drafted for "
                            "(chosen: request-steps), drafts it made, kept by pruning, accepted by the target",
                            ["drafter", "outcome"], registry=r)

        self._payoff = Gauge("dcut_engine_payoff_lead", "the payoff check's drafting arm over plain decoding, "
                             "tokens per second, by load band (its fewest decoding requests); below 1 the band "
                             "decodes plainly where the evidence says so (dcut_core/payoff.py)", ["requests"],
                             registry=r)
        self._leader = Gauge("dcut_engine_payoff_arm", "1 for the arm the payoff check plays in a load band (its "
                             "fewest decoding requests): drafting (the gate), plain, or kind:<k> (the gate over one "
                             "drafter kind), 0 for an arm it played before", ["requests", "arm"], registry=r)
        self._led: set[tuple[str, str]] = set()  # (band, arm) pairs the leader gauge has shown

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint, str(status)).inc()

    def tokens(self, n: int) -> None:
        self._tokens.inc(n)

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tpot(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def render(self, engine_stats: dict) -> bytes:
        for name, gauge in self._engine.items():
            gauge.set(float(engine_stats.get(name, 0.0)))
        for kind, counts in engine_stats.get("drafter_kinds", {}).items():
            for outcome, n in counts.items():
                self._kinds.labels(kind, outcome).set(float(n))
        for requests, lead in engine_stats.get("payoff_leads", {}).items():
            self._payoff.labels(str(requests)).set(float(lead))
        leaders = {(str(r), arm) for r, arm in engine_stats.get("payoff_leaders", {}).items()}
        for labels in self._led | leaders:
            self._leader.labels(*labels).set(1.0 if labels in leaders else 0.0)
        self._led |= leaders
        for rank, seconds in enumerate(engine_stats.get("rank_step_s", ())):
            self._ranks.labels(str(rank)).set(float(seconds))
        for gpu in engine_stats.get("gpus", ()):
            labels = (str(gpu["index"]), gpu["name"])
            self._gpu["memory_used_bytes"].labels(*labels).set(gpu["memory_used_bytes"])
            self._gpu["memory_total_bytes"].labels(*labels).set(gpu["memory_total_bytes"])
            self._gpu["utilization_ratio"].labels(*labels).set(gpu["utilization"])
        return generate_latest(self.registry)
