"""`dcut serve` as an operator runs it: SIGTERM (what systemd, Kubernetes and Ray send) drains —
a request in flight completes — and the process exits 0 without a stack dump."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

PORT = 8131
BASE = f"http://127.0.0.1:{PORT}"


def test_sigterm_drains_requests_in_flight_and_exits_cleanly(tiny_bundle, tmp_path):
    env = {**os.environ, "DCUT_COST_MODEL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--port", str(PORT), "--host",
                             "127.0.0.1", "--model", tiny_bundle], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"{BASE}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(1)
        else:
            raise AssertionError("the server did not come up")
        events, first = [], threading.Event()

        def client() -> None:
            body = {"model": "dcut-demo", "prompt": "w5 w6 w7 w5 w6 w7 w5", "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        t = threading.Thread(target=client)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(90)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "dcut stopped" in out
    assert events[-1] == "[DONE]"  # the request in flight finished
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
