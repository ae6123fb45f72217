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
    # Draining: Serve stops routing to the app and each replica finishes its requests in flight
    # within the deployment's graceful_shutdown_timeout_s before it stops.
    print(f"dcut draining (up to {settings.graceful_shutdown_timeout_s:.0f} s for requests in flight)", flush=True)
    serve.shutdown()
    ray.shutdown()
    print("dcut stopped", flush=True)
    return 0
