"""Faults at random under load for minutes: nothing lost, nothing wrong, nothing leaked (issue #27).

The served app on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head
and worker nodes, each a raylet of its own), EP 2 engine units whose ranks are placed
STRICT_SPREAD across nodes, the engine autoscaled between 1 and `--max-units` units, under
`--clients` streaming and non-streaming clients (greedy, and seeded sampling, which is
deterministic). The number of busy clients swings between all and a quarter every `--swing`
seconds, so the autoscaler adds and drains units meanwhile. Every `--interval` seconds (random
in the range) one fault, the kinds in shuffled rounds so each recurs:

- `kill_rank`: SIGKILL an EP rank's process (the unit rebuilds its group; requests resume);
- `kill_engine`: SIGKILL an engine replica's process (Serve replaces the unit; the ingress
  resubmits what was in flight);
- `remove_node`: remove a worker node holding part of a unit, then add a fresh node;
- `stall_rank`: SIGSTOP a rank past the stall timeout (the unit reports unhealthy and Serve
  replaces it), SIGCONT after;
- `restart_ingress`: SIGKILL the ingress replica's process (clients see dropped connections);
- `drop_clients`: half of the streaming clients hang up mid-stream (and ask again later).

A client retries what is retryable, as an OpenAI client does: 429 and 5xx (after `Retry-After`
when given), a dropped connection, a stream cut short or ended by an error event. Every request is
compared with an undisturbed run of the same requests on the same app before the first fault.

Report: requests sent, completed, resubmitted, failed (by status), lost (never completed),
wrong outputs; failed attempts by cause; recovery time per fault kind — from the fault until every
request in flight at that moment has completed and a probe request has succeeded — p50 and max;
request state left in each engine unit once idle (`held`, by owner: KV caches, drafter state,
trackers); resident memory of the Ray processes that lived through the whole run, first sample
after warm-up against the last; units over time.

    .venv/bin/python benchmarks/chaos.py --minutes 10 --out runs/chaos     # make chaos
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.ray_env import set_local_env  # noqa: E402

set_local_env()

FAULTS = ("kill_rank", "kill_engine", "remove_node", "stall_rank", "restart_ingress", "drop_clients")
APP = "chaos"
RETRYABLE = {429, 500, 502, 503, 504}


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool

    def body(self, model: str) -> dict:
        return {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed, "stream": self.stream}


@dataclasses.dataclass(frozen=True)
class Output:
    text: str
    token_ids: tuple[int, ...] | None  # non-streaming answers carry them (the `dcut` extension)

    def same(self, ref: Output) -> bool:
        return self.text == ref.text and (self.token_ids is None or self.token_ids == ref.token_ids)


@dataclasses.dataclass
class Proc:
    pid: int
    ppid: int
    title: str
    rss: int
    state: str = "R"  # T: stopped

def processes() -> dict[int, Proc]:
    """This machine's processes: title (Ray names its workers `ray::<actor class>`), parent, RSS."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            title = pathlib.Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state, ppid = pathlib.Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            rss = next((int(line.split()[1]) * 1024 for line in pathlib.Path(f"/proc/{d}/status").read_text()
                        .splitlines() if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        out[int(d)] = Proc(int(d), int(ppid), title.strip(), rss, state)
    return out


def request_set(tokenizer_path: str, n: int, seed: int) -> list[Request]:
    """n requests: prompts of the mixed workload's training draw (never the reported prompts),
    or repeating token patterns for a tokenizer too small for text; greedy and seeded sampling,
    streaming and not, 8–48 new tokens."""
    from tokenizers import Tokenizer

    from deployments.workload import mixed_prompts

    rng = random.Random(seed)
    tok = Tokenizer.from_file(tokenizer_path)
    vocab = tok.get_vocab_size()
    if vocab >= 1000:
        prompts = [tok.encode(text).ids[:200] for _, text in mixed_prompts(n, seed=23)]
    else:
        prompts = []
        for _ in range(n):
            motif = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
            prompts.append((motif * 8)[: rng.randrange(4, 24)])
    return [Request(i, p, rng.choice((8, 24, 48)), 0.0 if i % 2 == 0 else 0.8, None if i % 2 == 0 else 1000 + i,
                    stream=i % 4 in (1, 2)) for i, p in enumerate(prompts)]


@dataclasses.dataclass
class Done:
    client: int
    request: int
    start: float
    end: float | None = None  # None: never completed (lost)
    attempts: int = 0
    status: str = "ok"  # ok | wrong | failed:<status> | lost
    output: Output | None = None


class Chaos:
    """One run: the cluster and app, the clients, the faults, and what they observed."""

    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.url = f"http://127.0.0.1:{args.port}"
        self.model = "dcut-demo"
        self.done: list[Done] = []
        self.inflight: dict[int, Done] = {}  # client -> its request being served
        self.attempt_errors: dict[str, int] = {}
        self.faults: list[dict] = []  # the faults that hit something
        self.missed: dict[str, int] = {}  # kind -> attempts that found nothing to hit
        self.probes: list[tuple[float, float, bool]] = []
        self.units: list[tuple[float, int]] = []
        self.drop: set[int] = set()  # clients asked to hang up mid-stream
        self.streaming: set[int] = set()
        self.active = args.clients
        self.stop = threading.Event()  # the run is over: clients take no new request
        self.ready = threading.Event()  # the undisturbed run is done and the load is on
        self.rss_first: dict[int, Proc] | None = None
        self.t0 = 0.0
        self.deadline = float("inf")  # after the run: clients finish what they asked by then, or it is lost
        self.reference: dict[int, Output] = {}

    # -- cluster and app ----------------------------------------------------------------------

    def start(self) -> None:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        from deployments.app import build_app
        from deployments.settings import ServeSettings

        a = self.args
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(a.nodes):
            self.cluster.add_node(num_cpus=a.node_cpus)
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.cluster.wait_for_nodes()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": a.port})
        autoscaling = {"min_replicas": 1, "max_replicas": a.max_units, "initial_replicas": 1,
                       "target_ongoing_requests": max(1, a.clients // (2 * a.max_units)),
                       "upscale_delay_s": 5, "downscale_delay_s": 20, "metrics_interval_s": 1,
                       "look_back_period_s": 5} if a.max_units > 1 else None
        self.settings = ServeSettings(
            model_root=a.model_root, ep=2, unit_strategy="STRICT_SPREAD", drafter=a.drafter, block=a.block,
            threads_per_rank=1, cpus_per_rank=0.5, cpus_per_drafter=0.25, max_running=a.clients,
            stall_timeout_s=a.stall_timeout, group_timeout_s=a.group_timeout, health_check_period_s=1.0,
            graceful_shutdown_timeout_s=2.0,
            engine_autoscaling=autoscaling, cost_model_cache=self.cache())
        serve.run(build_app(self.settings), name=APP, route_prefix="/")
        self.requests = request_set(self.settings.resolved().engine_config().tokenizer_path, a.requests, a.seed)
        # The probe: short and greedy, so its answer says the app serves, not how long a request takes.
        first = self.requests[0]
        self.probe_request = Request(len(self.requests), first.prompt, 4, 0.0, None, stream=False)

    def cache(self) -> str:
        """A cost-model cache of this run's own, with the target's start-up profiles copied in (a
        unit does not profile for minutes at start; what the units learn stays out of the user's)."""
        from deployments.settings import ServeSettings

        cache = pathlib.Path(self.args.out) / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        for f in pathlib.Path(ServeSettings().cost_model_cache).glob("cost_model_*.json"):
            shutil.copy(f, cache)
        return str(cache)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        for p in processes().values():  # a rank left stopped would outlive the cluster
            if "ray::" in p.title:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
        serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()

    def procs(self, title: str) -> list[Proc]:
        return [p for p in processes().values() if p.title.startswith("ray::") and title in p.title]

    def node_of(self, proc: Proc):
        """The cluster node whose raylet started this worker."""
        return next((n for n in self.cluster.list_all_nodes()
                     if proc.ppid in [p.process.pid for p in n.all_processes.get("raylet", [])]), None)

    # -- clients ------------------------------------------------------------------------------

    async def send(self, http, cid: int, req: Request) -> tuple[str, Output | None]:
        """One attempt: ("ok", output), ("retry", None) with the cause counted, or ("failed:<status>", None)."""
        import httpx

        try:
            if not req.stream:
                r = await http.post(f"{self.url}/v1/completions", json=req.body(self.model))
                if r.status_code == 200:
                    body = r.json()
                    return "ok", Output(body["choices"][0]["text"], tuple(body["dcut"][0]["token_ids"]))
                return self._status(r.status_code, r.headers.get("retry-after"))
            text, finished = [], None
            async with http.stream("POST", f"{self.url}/v1/completions", json=req.body(self.model)) as r:
                if r.status_code != 200:
                    await r.aread()
                    return self._status(r.status_code, r.headers.get("retry-after"))
                self.streaming.add(cid)
                try:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            return self._cause(f"stream error {event['error'].get('code')}")
                        choice = event["choices"][0]
                        text.append(choice["text"])
                        finished = choice["finish_reason"] or finished
                        if cid in self.drop:
                            self.drop.discard(cid)
                            return self._cause("dropped by the client")
                finally:
                    self.streaming.discard(cid)
            return ("ok", Output("".join(text), None)) if finished else self._cause("stream cut short")
        except httpx.HTTPError as exc:
            return self._cause(type(exc).__name__)

    def _status(self, status: int, retry_after: str | None) -> tuple[str, None]:
        if status in RETRYABLE:
            return self._cause(f"HTTP {status}" + (" with Retry-After" if retry_after else ""))
        return f"failed:{status}", None

    def _cause(self, cause: str) -> tuple[str, None]:
        self.attempt_errors[cause] = self.attempt_errors.get(cause, 0) + 1
        return "retry", None

    async def complete(self, http, cid: int, req: Request) -> Done:
        """Ask until it completes, fails for good, or `deadline` passes (lost)."""
        d = Done(cid, req.index, time.monotonic())
        self.inflight[cid] = d
        try:
            while time.monotonic() < self.deadline:
                d.attempts += 1
                status, out = await self.send(http, cid, req)
                if status == "ok":
                    d.end, d.output = time.monotonic(), out
                    ref = self.reference.get(req.index)
                    d.status = "ok" if ref is None or out.same(ref) else "wrong"
                    return d
                if status != "retry":
                    d.end, d.status = time.monotonic(), status
                    return d
                await asyncio.sleep(0.5 + self.rng.random())
            d.status = "lost"
            return d
        finally:
            self.inflight.pop(cid, None)
            self.done.append(d)

    async def client(self, http, cid: int) -> None:
        """Requests one after another until the run ends (the one in hand is finished)."""
        rng = random.Random(self.args.seed * 1000 + cid)
        while not self.stop.is_set():
            if cid >= self.active:  # idle in the low phase of the load swing
                await asyncio.sleep(0.5)
                continue
            await self.complete(http, cid, rng.choice(self.requests))

    async def probe(self, http) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            status, out = await self.send(http, -1, self.probe_request)
            ok = status == "ok" and out.same(self.reference[self.probe_request.index])
            self.probes.append((t0, time.monotonic(), ok))
            await asyncio.sleep(0.5)

    # -- faults -------------------------------------------------------------------------------

    def inject(self, kind: str) -> tuple[str | None, int | None]:
        """Do one fault of `kind`: what it hit (None: nothing to hit) and the process hit."""
        if kind == "kill_rank" or kind == "stall_rank":
            ranks = [p for p in self.procs("TargetRank") if p.state != "T"]
            if not ranks:
                return None, None
            victim = self.rng.choice(ranks)
            if kind == "kill_rank":
                os.kill(victim.pid, signal.SIGKILL)
                return f"rank pid {victim.pid}", victim.pid
            os.kill(victim.pid, signal.SIGSTOP)
            threading.Timer(self.args.stall_timeout + 5, _cont, (victim.pid,)).start()
            return f"rank pid {victim.pid} stopped for {self.args.stall_timeout + 5:.0f} s", victim.pid
        if kind == "kill_engine" or kind == "restart_ingress":
            procs = self.procs(f"ServeReplica:{APP}:{'engine' if kind == 'kill_engine' else 'ingress'}")
            if not procs:
                return None, None
            victim = self.rng.choice(procs)
            os.kill(victim.pid, signal.SIGKILL)
            return f"pid {victim.pid}", victim.pid
        if kind == "remove_node":
            head = self.cluster.head_node
            nodes = {id(n): n for p in self.procs("TargetRank") + self.procs(f"ServeReplica:{APP}:engine")
                     if (n := self.node_of(p)) is not None and n is not head}
            if not nodes:
                return None, None
            victim = self.rng.choice(list(nodes.values()))
            self.cluster.remove_node(victim, allow_graceful=False)
            self.cluster.add_node(num_cpus=self.args.node_cpus)
            return f"node {victim.node_id[:8]} removed, a fresh one added", None
        raise ValueError(kind)

    def chaos(self, end: float) -> None:
        """Faults until `end`, on this (the main) thread (Ray's `Cluster` adds nodes only from it),
        and, between them, each fault's repair time: until the app is whole again (`whole`) and a
        probe sent after that succeeded. Faults come on schedule whether or not earlier ones are
        repaired. A fault that finds nothing to hit (no rank while the unit is being replaced, no
        stream open) is tried again two seconds later, and the run goes on past `end` (up to the
        drain) until every kind asked for has hit once: a chaos run that skipped a fault says
        nothing about it."""
        kinds: list[str] = []
        unhit = set(self.args.faults)
        next_at = time.monotonic() + self.rng.uniform(*self.args.interval)
        while (shape := self.shape()) is None or any(v != "HEALTHY" for v in shape["status"].values()):
            time.sleep(0.5)
        self.last_whole = shape
        while time.monotonic() < end or unhit or any(f["repaired_at"] is None for f in self.faults):
            now = time.monotonic()
            if now >= next_at and (now < end or unhit):
                if not kinds:
                    kinds = list(self.args.faults)
                    self.rng.shuffle(kinds)
                if self.fault(kinds[-1]):
                    unhit.discard(kinds.pop())
                    next_at = now + self.rng.uniform(*self.args.interval)
                else:
                    next_at = now + 2.0
            if now > end + self.args.drain:
                return
            shape = self.shape()
            if shape is not None and all(v == "HEALTHY" for v in shape["status"].values()):
                self.last_whole = shape
            self.check_repairs()
            time.sleep(0.5)

    def fault(self, kind: str) -> bool:
        """Inject one fault of `kind`; False (and nothing recorded but the miss) when there was
        nothing to hit."""
        t = time.monotonic()
        before = self.last_whole  # the app as last seen whole: what a repair restores
        in_flight = list(self.inflight.values())
        if kind == "drop_clients":
            wait = time.monotonic() + 10
            while not self.streaming and time.monotonic() < wait:  # hang up on streams that exist
                time.sleep(0.1)
            streaming = sorted(self.streaming)
            chosen = self.rng.sample(streaming, len(streaming) // 2 + 1) if streaming else []
            self.drop.update(chosen)
            what, victim = (f"{len(chosen)} streams" if chosen else None), None
        else:
            what, victim = self.inject(kind)
        if what is None:
            self.missed[kind] = self.missed.get(kind, 0) + 1
            return False
        self.faults.append({"kind": kind, "t": t, "what": what, "victim": victim, "before": before,
                            "in_flight": in_flight, "whole_at": None, "repaired_at": None})
        print(f"[{t - self.t0:6.1f} s] {kind}: {what} ({len(in_flight)} in flight)", flush=True)
        return True

    def shape(self) -> dict | None:
        """Each deployment's status and running replicas (Serve's view), and the live (not
        stopped) rank processes; None while the app is not running."""
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None or app.status != "RUNNING":
            return None
        live = [p for p in processes().values() if p.state != "T" and "TargetRank" in p.title]
        return {"status": {k: d.status for k, d in app.deployments.items()},
                "running": {k: d.replica_states.get("RUNNING", 0) for k, d in app.deployments.items()},
                "ranks": len(live)}

    def whole(self, f: dict) -> bool:
        """The app as before the fault: a killed victim gone, no deployment
        unhealthy or mid-replacement, as many replicas of each running as before (Serve's count;
        the autoscaler may be adding more meanwhile) and as many live ranks."""
        # A killed process must be gone. A stopped rank is judged by its unit: once the group is
        # rebuilt without it, the new rank counts among the live ones and the old process (which
        # Ray marked dead) lingers until it runs again (the SIGCONT after the stall) and exits.
        if f["victim"] is not None and f["kind"] != "stall_rank" and f["victim"] in processes():
            return False
        now = self.shape()
        if now is None or any(d in ("UNHEALTHY", "UPDATING") for d in now["status"].values()):
            return False
        return all(now["running"].get(k, 0) >= n for k, n in f["before"]["running"].items()) \
            and now["ranks"] >= f["before"]["ranks"]

    def check_repairs(self) -> None:
        """Each pending fault: when the app first looks whole again (from a second after the fault:
        Serve needs a moment to notice a death), and then the first probe sent after that which
        succeeds. A fault whose repair was not seen before the next one's counts from its own time."""
        now = time.monotonic()
        pending = [f for f in self.faults if f["repaired_at"] is None]
        for f in pending:
            if f["whole_at"] is None and now - f["t"] >= 1.0 and self.whole(f):
                f["whole_at"] = now
            if f["whole_at"] is not None:
                probe = next((e for s, e, ok in list(self.probes) if s >= f["whole_at"] and ok), None)
                if probe is not None:
                    f["repaired_at"] = probe

    async def watch(self) -> None:
        """Units over time, and the load swing."""
        high = True
        next_swing = time.monotonic() + self.args.swing
        while not self.stop.is_set():
            self.units.append((time.monotonic() - self.t0, len(self.procs(f"ServeReplica:{APP}:engine"))))
            if self.args.swing and time.monotonic() > next_swing:
                high, next_swing = not high, next_swing + self.args.swing
                self.active = self.args.clients if high else max(1, self.args.clients // 4)
            await asyncio.sleep(2)

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict:
        """The load on a thread of its own (its event loop: clients, probe, watch), the faults on
        this one; then the units' state once idle, memory, and the report."""
        a = self.args
        box: dict = {}
        load = threading.Thread(target=lambda: box.update(asyncio.run(self.load())), daemon=True)
        load.start()
        while not self.ready.wait(1.0):
            if not load.is_alive():
                raise RuntimeError("the load ended before it began (see above)")
        end = self.t0 + a.minutes * 60
        self.chaos(end)
        time.sleep(max(0.0, end - time.monotonic()))
        rss_first = self.rss_first or self.rss_now()  # (a run shorter than its warm-up)
        self.deadline = time.monotonic() + a.drain
        self.stop.set()
        load.join()
        held = self.held()
        rss_last = processes()
        drift = {f"{p.pid}:{name_of(p)}": rss_last[pid].rss / p.rss - 1 for pid, p in rss_first.items()
                 if pid in rss_last and name_of(rss_last[pid]) == name_of(p)}  # the same process, not a reused pid
        return self.report(box["reference_s"], held, drift)

    async def load(self) -> dict:
        """The undisturbed run, then the clients until `stop` and the drain."""
        import httpx

        a = self.args
        out: dict = {}
        limits = httpx.Limits(max_connections=a.clients + 8, max_keepalive_connections=a.clients + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10), limits=limits) as http:
            t = time.monotonic()
            sem = asyncio.Semaphore(a.clients)

            async def once(req: Request) -> None:
                async with sem:
                    d = await self.complete(http, 10_000 + req.index, req)
                    if d.status != "ok":
                        raise RuntimeError(f"the undisturbed run failed: request {req.index}: {d.status}")
                    self.reference[req.index] = d.output

            await asyncio.gather(*(once(r) for r in [*self.requests, self.probe_request]))
            out["reference_s"] = time.monotonic() - t
            self.done.clear()
            self.attempt_errors.clear()
            print(f"undisturbed run: {len(self.requests)} requests in {out['reference_s']:.1f} s", flush=True)
            self.t0 = time.monotonic()
            tasks = [asyncio.create_task(self.client(http, c)) for c in range(a.clients)]
            helpers = [asyncio.create_task(self.probe(http)), asyncio.create_task(self.watch())]
            self.ready.set()
            await asyncio.sleep(min(60.0, a.minutes * 60 / 5))
            self.rss_first = self.rss_now()  # warmed up
            await asyncio.gather(*tasks)
            for h in helpers:
                h.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        return out

    @staticmethod
    def rss_now() -> dict[int, Proc]:
        """The Ray processes over 50 MB."""
        return {p.pid: p for p in processes().values() if "ray" in p.title and p.rss > 50 * 2**20}

    def held(self) -> dict:
        """Each live engine unit's request state, once idle (the handle routes at random: ask
        until every unit answered)."""
        from ray import serve

        handle = serve.get_deployment_handle("engine", app_name=APP)
        units = {p.pid for p in self.procs(f"ServeReplica:{APP}:engine")}
        seen: dict[int, dict] = {}
        for _ in range(8 * max(1, len(units))):
            h = handle.held.remote().result(timeout_s=120)
            seen[h.pop("pid")] = h
            if units <= set(seen):
                break
        return {"units": len(units), "answered": len(seen), "by_unit": seen}

    def report(self, reference_s: float, held: dict, drift: dict) -> dict:
        by_kind: dict[str, list[float | None]] = {}
        affected: dict[str, list[float | None]] = {}
        overlapped: dict[str, int] = {}
        for f in self.faults:
            by_kind.setdefault(f["kind"], [])
            affected.setdefault(f["kind"], [])
            overlapped.setdefault(f["kind"], 0)
            later = next((g["t"] for g in self.faults if g["t"] > f["t"]), None)
            if f["repaired_at"] is not None and later is not None and f["repaired_at"] > later:
                overlapped[f["kind"]] += 1  # the next fault struck first: its repair is not this one's alone
                continue
            by_kind[f["kind"]].append(None if f["repaired_at"] is None else f["repaired_at"] - f["t"])
            ends = [d.end for d in f["in_flight"]]
            affected[f["kind"]].append(None if None in ends else max(ends, default=f["t"]) - f["t"])
        recovery = {k: {"faults": len(v) + overlapped[k], "overlapped": overlapped[k], "p50_s": _q(v, 0.5),
                        "max_s": _q(v, 1.0),
                        "unrecovered": sum(x is None for x in v), "in_flight_done_max_s": _q(affected[k], 1.0)}
                    for k, v in by_kind.items()}
        statuses: dict[str, int] = {}
        for d in self.done:
            statuses[d.status] = statuses.get(d.status, 0) + 1
        leaked = {pid: {k: v for k, v in h.items() if v} for pid, h in held["by_unit"].items()}
        return {
            "minutes": self.args.minutes, "clients": self.args.clients, "requests_distinct": len(self.requests),
            "undisturbed_s": reference_s,
            "sent": len(self.done), "completed": statuses.get("ok", 0) + statuses.get("wrong", 0),
            "resubmitted": sum(d.attempts - 1 for d in self.done), "wrong": statuses.get("wrong", 0),
            "lost": statuses.get("lost", 0),
            "failed": {s: n for s, n in statuses.items() if s.startswith("failed")},
            "failed_attempts": self.attempt_errors,
            "faults": [{"kind": f["kind"], "what": f["what"], "t": round(f["t"] - self.t0, 1),
                        "repair_s": None if f["repaired_at"] is None else round(f["repaired_at"] - f["t"], 2)}
                       for f in self.faults],
            "missed": self.missed,
            "recovery": recovery, "held": held, "leaked": {p: v for p, v in leaked.items() if v},
            "rss_drift_worst": max(drift.values(), default=0.0), "rss_drift": drift,
            "units": {"min": min((u for _, u in self.units), default=0), "max": max((u for _, u in self.units),
                                                                                  default=0),
                      "changes": sum(a[1] != b[1] for a, b in zip(self.units, self.units[1:], strict=False))},
            "probes": {"sent": len(self.probes), "ok": sum(ok for *_, ok in self.probes)},
        }


def name_of(p: Proc) -> str:
    """`ray::ServeReplica:chaos:engine`, `raylet`, `gcs_server`, `python`: what the process is."""
    word = p.title.split()[0] if p.title else ""
    return word.split(".")[0] if word.startswith("ray::") else word.rsplit("/", 1)[-1]


def _cont(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


def _q(xs: list[float | None], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def goals(r: dict, full: bool = True) -> dict[str, bool]:
    """Issue #27's goals, each True when met. A short run (`full=False`: a few faults, under a
    minute, as in `make test`) is held to those that mean something there: memory still settles
    in its first minutes, it does not inject every kind, and how fast a repair is depends on how
    loaded the machine is (a unit replaced in 17 s under `make chaos` took 30 s in one CI run)
    — a timed bound belongs to the benchmark, not to the test."""
    return {
        "no request lost or failed": r["lost"] == 0 and not r["failed"],
        "no wrong output": r["wrong"] == 0,
        "no request state left": not r["leaked"] and r["held"]["answered"] == r["held"]["units"],
        "RSS drift <= 5 %": not full or r["rss_drift_worst"] <= 0.05,
        "every fault repaired": all(v["unrecovered"] == 0 for v in r["recovery"].values()),
        "repair max <= 15 s": not full or all((v["max_s"] or 0) <= 15 for v in r["recovery"].values()),
        "every kind at least twice": not full or all(
            sum(f["kind"] == k for f in r["faults"]) >= 2 for k in FAULTS),
    }


def markdown(r: dict) -> str:
    lines = [f"{r['minutes']} min, {r['clients']} clients, {len(r['faults'])} faults: sent {r['sent']}, completed "
             f"{r['completed']}, resubmitted {r['resubmitted']}, failed {sum(r['failed'].values())}, lost {r['lost']}, "
             f"wrong {r['wrong']}; units {r['units']['min']}–{r['units']['max']} ({r['units']['changes']} changes); "
             f"worst RSS drift {100 * r['rss_drift_worst']:+.1f} %; request state left: {r['leaked'] or 'none'}; "
             f"faults tried again for want of a target: {r['missed'] or 'none'}",
             "", "| fault | injected | repaired in, p50 (s) | max (s) | not repaired | next fault came first | "
                 "requests in flight at it: all done within (s) |", "|---|---|---|---|---|---|---|"]
    for k, v in r["recovery"].items():
        lines.append(f"| {k} | {v['faults']} | {v['p50_s']} | {v['max_s']} | {v['unrecovered']} | {v['overlapped']} | "
                     f"{v['in_flight_done_max_s']} |")
    causes = ", ".join(f"{k} {v}" for k, v in sorted(r["failed_attempts"].items()))
    lines += ["", f"Failed attempts (retried): {causes or 'none'}"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from deployments.bundle import BUNDLED

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="distinct requests the clients draw from")
    p.add_argument("--interval", type=lambda s: tuple(map(float, s.split(","))), default=(18.0, 34.0),
                   help="seconds between faults: low,high")
    p.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS))
    p.add_argument("--nodes", type=int, default=3, help="worker nodes")
    p.add_argument("--node-cpus", type=int, default=2)
    p.add_argument("--max-units", type=int, default=2, help="engine units the autoscaler may run (1: off)")
    p.add_argument("--swing", type=float, default=60.0, help="seconds between load swings (0: none)")
    p.add_argument("--stall-timeout", type=float, default=15.0, help="a unit whose steps stall this long is replaced")
    p.add_argument("--group-timeout", type=float, default=5.0,
                   help="a collective waiting this long on a rank fails the step: the unit rebuilds its group")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--drain", type=float, default=120.0, help="seconds clients may take to finish after the run")
    p.add_argument("--model-root", default=str(BUNDLED))
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--port", type=int, default=8161)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/chaos")
    return p


def run(args) -> dict:
    """Start, run, tear down; the report (also written to `args.out`)."""
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args)
    chaos.start()
    try:
        report = chaos.run()
    finally:
        chaos.shutdown()
    report["goals"] = goals(report, full=args.minutes >= 5 and set(args.faults) == set(FAULTS))
    pathlib.Path(args.out, "report.json").write_text(json.dumps(report, indent=1, default=str))
    pathlib.Path(args.out, "report.md").write_text(markdown(report) + "\n")
    return report


def main() -> int:
    import torch

    torch.set_num_threads(1)  # the driver only sends requests; the cores are the ranks'
    report = run(parser().parse_args())
    print(markdown(report))
    print(json.dumps(report["goals"], indent=1))
    return 0 if all(report["goals"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
