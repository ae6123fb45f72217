"""Shared by the OpenAI-API test modules (their fixtures are in conftest.py): where the server
listens, the prompt they decode, and the liveness check every odd request is followed by."""

from __future__ import annotations

import httpx

PORT = 8127
BASE = f"http://127.0.0.1:{PORT}"
PROMPT = "w5 w6 w7 w5 w6 w7 w5"
PROMPT_IDS = [5, 6, 7, 5, 6, 7, 5]


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def assert_still_serving(client) -> None:
    """A plain request completes promptly, and /health says the engine is fine."""
    out = client.completions.create(model="dcut-demo", prompt="w1 w2", max_tokens=2, temperature=0, timeout=30)
    assert out.choices[0].finish_reason == "length"
    health = httpx.get(f"{BASE}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
