"""The coordinator's own time, one commit against the working tree (issue #26).

`benchmarks/coordinator.py` measures the engine's own time per step by stage over a zero-cost
target. A whole process's own time moves ±30 % between processes on this machine while its
stages move together (docs/benchmarks.md, session 43), so a change to the step's Python worth
5–15 % shows only as medians of alternating rounds, and most clearly per stage. Here `--base`
is checked out as a git worktree (removed at the end) beside the working tree (`new`); each round
runs coordinator.py once in each checkout, in fresh processes, the order swapped every other
round, both deciding by the same cached start-up profile (the working tree's `runs/cache`,
copied). Reported per (policy, requests): each stage's median over rounds, base → new, and the
own time's new / base by round (median [range]).

    .venv/bin/python benchmarks/coordinator_ab.py --base HEAD~1 --rounds 6 --requests 64,1024 \\
        --policies ar:8,full:16 --out runs/coordinator-ab
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ("own", "commit", "verify", "plan", "prune", "accept")  # coordinator.py's `<stage>_ms`


def run_one(tree: pathlib.Path, args: argparse.Namespace, out: pathlib.Path) -> list[dict]:
    """coordinator.py in checkout `tree` (its own code: the script puts its checkout first on the
    path), in a fresh process; its rows."""
    cache = tree / "runs" / "cache"
    if tree != ROOT and (ROOT / "runs" / "cache").is_dir():  # the same profile for both sides
        cache.mkdir(parents=True, exist_ok=True)
        for f in (ROOT / "runs" / "cache").glob("cost_model_*.json"):
            shutil.copy(f, cache / f.name)
    cmd = [sys.executable, "benchmarks/coordinator.py", "--requests", args.requests, "--policies", args.policies,
           "--forward", args.forward, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"coordinator.py failed in {tree}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads((out / "results.json").read_text())


def summary(rows: list[dict]) -> list[dict]:
    """Per (policy, requests): medians over rounds of each column, both sides, and new / base of
    the own time by round."""
    out = []
    keys = list(dict.fromkeys((r["policy"], r["block"], r["requests"]) for r in rows))
    for policy, block, requests in keys:
        mine = [r for r in rows if (r["policy"], r["block"], r["requests"]) == (policy, block, requests)]
        side = {s: {r["round"]: r for r in mine if r["side"] == s} for s in ("base", "new")}
        rounds = sorted(side["base"].keys() & side["new"].keys())
        ratio = [side["new"][k]["own_ms"] / side["base"][k]["own_ms"] for k in rounds]
        out.append({"policy": policy, "block": block, "requests": requests, "rounds": len(rounds),
                    **{f"{c}_{s}": statistics.median(side[s][k][f"{c}_ms"] for k in rounds)
                       for c in COLUMNS for s in ("base", "new")},
                    "ratio": statistics.median(ratio), "ratio_min": min(ratio), "ratio_max": max(ratio)})
    return out


def render(rows: list[dict], base: str) -> str:
    lines = [f"| policy (drafts ≤) | R | rounds | {' | '.join(f'{c} ms {base} → new' for c in COLUMNS)} "
             "| own new / base by round |", "|---" * (4 + len(COLUMNS)) + "|"]
    for r in rows:
        cells = " | ".join(f"{r[c + '_base']:.2f} → {r[c + '_new']:.2f}" for c in COLUMNS)
        lines.append(f"| {r['policy']} ({r['block'] - 1}) | {r['requests']} | {r['rounds']} | {cells} | "
                     f"{r['ratio']:.2f} [{r['ratio_min']:.2f}–{r['ratio_max']:.2f}] |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit (any git revision) the working tree is measured against")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", default="64,1024")
    p.add_argument("--policies", default="ar:8,full:16,dcut:8", help="policy:block, comma-separated")
    p.add_argument("--forward", default="none", help="as coordinator.py's (none: a zero-cost forward)")
    p.add_argument("--out", default="runs/coordinator-ab")
    args = p.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.base}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if rev.returncode != 0:
        p.error(f"--base {args.base!r} is not a commit of this repository")
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = pathlib.Path(tempfile.mkdtemp(prefix="coordinator-ab-")) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev.stdout.strip()], cwd=ROOT,
                   check=True)
    rows = []
    try:
        for k in range(args.rounds):
            sides = [("base", tree), ("new", ROOT)]
            for name, checkout in sides if k % 2 == 0 else sides[::-1]:
                for r in run_one(checkout, args, out / f"{name}-{k}"):
                    rows.append({**r, "side": name, "round": k})
                print(f"round {k} {name} done", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
        shutil.rmtree(tree.parent, ignore_errors=True)
    table = summary(rows)
    (out / "results.json").write_text(json.dumps({"base": args.base, "runs": rows, "summary": table}, indent=1))
    md = render(table, args.base)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
