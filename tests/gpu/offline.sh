#!/usr/bin/env bash
# tests/gpu/run.sh on a CUDA machine with no package registry (how the first GPU runs were made):
# unpacks what tests/gpu/bundle.sh packed, runs the checks, then `dcut bench` in the checkpoint's
# own dtype (as `dcut serve` serves it) with the block, n-gram and MTP drafters, and packs every log into
# one archive. Usage, from the repository root on that machine:
#   RESULTS=/tmp/gpu ARCHIVE=/somewhere/gpu.tgz bash tests/gpu/offline.sh [BUNDLE_DIR]
# (SERVED="ngram mtp": which drafters' served benches to run, default block ngram mtp, "" none;
# RUN_LIMIT: seconds for run.sh, default 480)
# The machine needs python3 with torch (CUDA), numpy, msgpack, safetensors, tokenizers, jinja2, tqdm,
# matplotlib, pytest and hypothesis; the bundle brings Ray, pydantic, jsonschema and llguidance.
set -o pipefail
cd "$(dirname "$0")/../.."
bundle=${1:-.gpu_bundle}
site=${SITE:-/tmp/site}
results=${RESULTS:-runs/gpu}
archive=${ARCHIVE:-$results.tgz}
mkdir -p "$site" "$results"
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 )) s"; }
for a in "$bundle"/*.tar.xz; do tar -xJf "$a" -C "$site" || { echo "unpacking $a failed"; exit 3; }; done
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PYTHON" -c "import ray, torch, numpy; print('ray', ray.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"

report() {
  tar -czf "$archive" -C "$(dirname "$results")" "$(basename "$results")"
  echo "=== summary"; cat "$results/summary.txt"
  echo "=== test_cuda"; grep -E '^(FAILED|ERROR|SKIPPED)|passed|failed' "$results/test_cuda.log" | tail -20
  echo "=== coordinator"; cut -c1-160 "$results/coordinator/table.md" 2>/dev/null | head -16
  echo "=== rank_step"; cut -c1-240 "$results/rank_step/table.md" 2>/dev/null
  for d in $(for k in ${SERVED-block ngram mtp}; do echo "served_$k"; done) graphs_auto graphs_off; do
    echo "=== $d"
    "$PYTHON" - "$results/$d/results.json" <<'PY' 2>&1 | tail -8
import json, sys
keys = ["policy", "concurrency", "output_tok_s", "speedup_vs_ar", "mat", "lossless", "step_ms_mean",
        "target_compute_ms_mean", "draft_ms_mean"]
for r in json.load(open(sys.argv[1])):
    print(" ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys))
PY
  done
  echo "archive $archive after $(elapsed)"
}
trap report EXIT
OUT=$results timeout "${RUN_LIMIT:-480}" bash tests/gpu/run.sh
rc=$?; echo "run.sh exit $rc after $(elapsed)"
[ "$rc" = 2 ] && exit 2  # no GPU: nothing to bench either
# block: the engine check's drafter in float32, here in float16 (the first run's float16 `ar` with
# MTP took twice float32's with block: dtype or drafter?)
for d in ${SERVED-block ngram mtp}; do  # SERVED="": none; 12 prompts at C = 1 (C = 16: 48), 48 tokens each
  DCUT_GPUS_PER_RANK=1 timeout "${SERVED_LIMIT:-90}" "$PYTHON" -m deployments.cli bench --ep 1 --concurrency 1,16 \
    --policies ar,dcut --drafter $d --num-prompts 12 --max-tokens 48 --out "$results/served_$d" \
    > "$results/served_$d.log" 2>&1
  echo "served $d exit $? after $(elapsed)"
done
