"""`dcut serve`: local Ray on loopback + the Serve app with the bundled model."""

from __future__ import annotations

import argparse
import json
import pathlib
import time


def run(args: argparse.Namespace) -> int:
    from ray import serve

    from actors.ray_env import start_local_ray
    from deployments.app import build_app
    from deployments.settings import ServeSettings

    overrides = json.loads(pathlib.Path(args.config).read_text()) if args.config else {}
    overrides |= {k: v for k, v in (("model_root", args.model), ("drafter", args.drafter)) if v}
    settings = ServeSettings.from_env(**overrides)
    settings.engine_config()  # fail fast (missing bundle, bad settings) before starting Ray
    start_local_ray(num_cpus=settings.local_cpus())
    serve.start(http_options={"host": args.host, "port": args.port})
    t0 = time.time()
    serve.run(build_app(settings), name="dcut", route_prefix="/")
    print(f"dcut serving {settings.model_name} on http://{args.host}:{args.port} "
          f"(ready in {time.time() - t0:.1f} s; Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
