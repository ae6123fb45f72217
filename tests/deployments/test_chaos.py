"""The short version of `make chaos` (issue #27): the served app on a multi-node cluster of this
machine, an EP 2 unit spread over two nodes, eight clients streaming and not, greedy and seeded,
and three faults at random — a rank killed, the engine replica killed, clients hanging up
mid-stream. Every request completes with exactly the undisturbed output, no request state is
left in the unit, and each fault is recovered from (benchmarks/chaos.py)."""

from __future__ import annotations

from benchmarks.chaos import parser, run


def test_faults_at_random_under_load_lose_nothing(tiny_bundle, tmp_path):
    args = parser().parse_args([
        "--minutes", "0.6", "--clients", "8", "--requests", "24", "--interval", "8,12",
        "--faults", "kill_rank,kill_engine,drop_clients", "--nodes", "2", "--max-units", "1", "--swing", "0",
        "--drain", "90", "--model-root", tiny_bundle, "--block", "6", "--port", "8163",
        "--out", str(tmp_path)])
    r = run(args)
    assert {f["kind"] for f in r["faults"]} == {"kill_rank", "kill_engine", "drop_clients"}, r["faults"]
    assert r["completed"] >= 30 and r["resubmitted"] > 0, r  # the faults met requests in flight
    assert r["goals"] == dict.fromkeys(r["goals"], True), (r["goals"], r)
