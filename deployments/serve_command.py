"""`dcut serve`: local Ray on loopback + the Serve app with the bundled model."""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import threading
import time


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from actors.ray_env import start_local_ray
    from deployments.app import build_app
    from deployments.settings import ServeSettings

    overrides = json.loads(pathlib.Path(args.config).read_text()) if args.config else {}
    overrides |= {k: v for k, v in (("model_root", args.model), ("drafter", args.drafter)) if v}
    settings = ServeSettings.from_env(**overrides)
    settings.engine_config()  # fail fast (missing bundle, bad settings) before starting Ray
    start_local_ray(num_cpus=settings.local_cpus())
    # Ours from here on (Ray's own handler aborts with a stack dump): a stop asked for while the
    # app is still starting is honoured once it is up.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # what systemd, Kubernetes and Ray send; and Ctrl-C
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": args.host, "port": args.port})
    t0 = time.time()
    serve.run(build_app(settings), name="dcut", route_prefix="/")
    print(f"dcut serving {settings.model_name} on http://{args.host}:{args.port} "
          f"(ready in {time.time() - t0:.1f} s; Ctrl-C or SIGTERM stops)", flush=True)
    while not stop.wait(3600):
        pass
    drain(settings.graceful_shutdown_timeout_s)
    serve.shutdown()
    ray.shutdown()
    print("dcut stopped", flush=True)
    return 0


def drain(timeout_s: float) -> None:
    """Let the requests in flight finish (up to timeout_s) before Serve goes: its shutdown
    closes the HTTP proxy at once, cutting open streams. Requests arriving meanwhile are served
    too; what is still running at the deadline is cut."""
    from ray import serve

    print(f"dcut draining (up to {timeout_s:.0f} s for requests in flight)", flush=True)
    engine = serve.get_deployment_handle("engine", app_name="dcut")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if engine.health.remote().result(timeout_s=5).in_flight == 0:
                time.sleep(0.5)  # the last deltas' way out through the ingress and the proxy
                return
        except Exception as exc:  # the engine is gone already: nothing to wait for
            print(f"dcut draining: the engine did not answer ({type(exc).__name__})", flush=True)
            return
        time.sleep(0.1)
