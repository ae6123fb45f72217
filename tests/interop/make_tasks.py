"""Writes the local lm-eval tasks' data (tests/interop/tasks/*.jsonl) from the validation split
of the demo model's corpus: files neither demo model trained on, in the domain it knows (Python).

Run once when the tasks change (`python -m tests.interop.make_tasks`); the files are committed,
so `make interop` reads them as they are and any machine scores the same documents.
"""

from __future__ import annotations

import ast
import json
import pathlib

import numpy as np

from deployments.workload import functions

TASKS = pathlib.Path(__file__).parent / "tasks"


def bodies(limit: int = 400) -> list[list[str]]:
    """The lines of every (non-async) function of six lines or more, up to about `limit`
    functions (whole files), in the corpus's order."""
    out, last = [], None
    for node, lines in functions("validation"):
        if len(out) >= limit and lines is not last:
            break
        last = lines
        body = lines[node.lineno - 1: node.end_lineno]
        if isinstance(node, ast.FunctionDef) and all(len(line) < 100 for line in body[:6]) and body[2].strip():
            out.append(body)
    return out


def main() -> None:
    rng = np.random.default_rng(7)
    funcs = bodies()
    order = rng.permutation(len(funcs))
    picked = [funcs[i] for i in order[:56]]
    mc = []
    for i, body in enumerate(picked[:24]):  # which third line follows the first two
        others = [picked[(i + k) % 24][2] for k in (5, 11, 17)]
        label = int(rng.integers(4))
        choices = [*others[:label], body[2], *others[label:]]
        mc.append({"context": "\n".join(body[:2]) + "\n", "choices": choices, "label": label})
    rolling = [{"text": "\n".join(body[:8])[:360]} for body in picked[24:36]]
    gen = [{"prompt": "\n".join(body[:2]) + "\n", "completion": "\n".join(body[2:4])} for body in picked[36:52]]
    for name, rows in (("code_mc", mc), ("code_rolling", rolling), ("code_gen", gen)):
        with open(TASKS / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{name}: {len(rows)} documents")


if __name__ == "__main__":
    main()
