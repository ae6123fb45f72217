#!/usr/bin/env bash
# GPU checks for one CUDA machine, under 5 minutes (issue #15, item 7). Run from the repository
# root: `bash tests/gpu/run.sh` (writes to ${OUT:-runs/gpu}). What it checks:
#   1. the target on CUDA at EP 1: logits and features within tolerance of CPU fp32, dispatch on
#      one device (tests/gpu/test_cuda.py);
#   1b. FP8 checkpoints keep FP8 weights on capability >= 9.0 (F.scaled_mm block-wise), logits ≈ dequantized;
#   1c. NVML sees the GPUs (the GPU gauges of /metrics and the dashboard);
#   2. if Ray is importable there: every policy's greedy output equals `ar` with the rank on the
#      GPU (the engine tests, EP 1), and a short bench of `ar` and `dcut`.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' | tee "$out/env.txt"
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib tests/gpu/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
status=${PIPESTATUS[0]}
if python3 -c 'import ray' 2>/dev/null; then
  DCUT_GPUS_PER_RANK=1 timeout 180 python3 -m deployments.cli bench --ep 1 --concurrency 1,16 --policies ar,dcut \
    --num-prompts 16 --max-tokens 32 --out "$out/bench" 2>&1 | tail -n 5 | tee "$out/bench.log"
else
  echo "ray is not installed here: engine-level checks skipped (carry its wheels to run them)" | tee "$out/bench.log"
fi
exit "$status"
