#!/usr/bin/env bash
# Packs what a bare CUDA machine lacks to run tests/gpu/run.sh: Ray (core, no Java, dashboard UI,
# RLlib, Tune, Train or Data; binaries stripped) and the Python packages this project needs beyond
# a stock PyTorch image (pydantic, jsonschema, llguidance and their own needs), for one Python
# version, as two xz archives small enough to travel with the working tree (~21 MB for both; the
# repository itself is ~43 MB). For machines with no package registry. Usage:
#   bash tests/gpu/bundle.sh [PYVER] [DIR]        # default 3.12 .gpu_bundle
# then there:
#   mkdir -p /tmp/site && for a in DIR/*.tar.xz; do tar -xJf $a -C /tmp/site; done
#   PYTHONPATH=/tmp/site PYTHON=python3 bash tests/gpu/run.sh
# Versions are this project's pins as installed in .venv (pyproject.toml).
set -euo pipefail
pyver=${1:-3.12}
dest=$(realpath -m "${2:-.gpu_bundle}")
cd "$(dirname "$0")/../.."
pip=(python3 -m pip)
[ -x .venv/bin/python ] && pip=(.venv/bin/python -m pip)
version() { "${pip[@]}" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
platforms=(--platform manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
pick=(--no-deps --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
names=(ray pydantic pydantic_core annotated-types typing-inspection typing_extensions jsonschema
       jsonschema-specifications referencing rpds-py llguidance)
specs=()
for n in "${names[@]}"; do
  v=$(version "$n"); [ -n "$v" ] || { echo "bundle: $n is not installed in .venv" >&2; exit 1; }
  specs+=("$n==$v")
done
"${pip[@]}" download -q "${pick[@]}" -d "$work/wheels" "${specs[@]}"
"${pip[@]}" install -q --no-compile "${pick[@]}" --target "$work/site" "$work"/wheels/*.whl
cd "$work/site"
rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/tune ray/train ray/data ray/air ray/llm bin
find . -name __pycache__ -prune -exec rm -rf {} +
find . -name '*.so' -exec strip {} +
binaries=(ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet)
strip "${binaries[@]}"
mkdir -p "$dest"
# One solid archive for the three Ray binaries: they share most of their code, and a dictionary
# as large as all of them compresses them to ~14 MB instead of ~20 MB one by one.
tar -cf - "${binaries[@]}" | xz -9e --lzma2=dict=192MiB -T1 > "$dest/ray-binaries.tar.xz"
tar -cf - "${binaries[@]/#/--exclude=}" . | xz -9 -T2 > "$dest/python.tar.xz"
ls -l "$dest"
