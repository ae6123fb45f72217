"""Starting Ray on one machine, kept on loopback.

Ray advertises the machine's external address by default and, from 2.60, turns on token
authentication. For local runs and tests both are set off before Ray is *imported* (Ray reads
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into a constant at import time) and so before any Ray process
starts (NOTES.md: `_node_ip_address` alone does not keep listeners on 127.0.0.1). Entry points
(the command line, tests' conftest) call `set_local_env()` first. Callers that manage a real
cluster do not use this module.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every listener and connection on 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",  # gloo's EP group over loopback
    # The GCS keeps an event record of every task for the state API, up to 100 000 by default; a
    # serving engine makes several actor calls per step, and the soak saw the GCS grow 6 MB a
    # minute without end in sight. 10 000 bounds it and still covers the last minute or so.
    "RAY_task_events_max_num_task_in_gcs": "10000",
    # How long a raylet lets a worker it was told to kill exit by itself before SIGKILL (5 s by
    # default). A rank that stopped answering (hung, SIGSTOPped) never exits by itself, and its
    # placement-group bundle, which its replacement needs, stays taken until it is gone: 1 s
    # takes 4 s off every in-place rebuild after a stall (benchmarks/chaos.py, docs/operations.md).
    "RAY_kill_worker_timeout_milliseconds": "1000",
}


def set_local_env() -> None:
    """Apply LOCAL_RAY_ENV to this process (and so to every Ray process it starts)."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)


def start_local_ray(num_cpus: int | None = None, **kwargs) -> None:
    """A fresh single-node Ray on loopback (never joins a stale cluster from a temp file)."""
    set_local_env()  # still reaches the Ray processes started below
    import ray

    if ray._private.ray_constants.ENABLE_RAY_CLUSTER:
        log.warning("Ray was imported before set_local_env(): it will listen on the machine's address, "
                    "not only on 127.0.0.1")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kwargs)


def whereabouts() -> dict[str, str | int | None]:
    """The node and placement group (hex ids) and the process id of the calling worker: where an
    actor really runs."""
    import ray

    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    return {"node": ctx.get_node_id(), "placement_group": pg, "pid": os.getpid()}
