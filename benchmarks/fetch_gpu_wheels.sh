#!/usr/bin/env bash
# Fetch the wheels benchmarks/gpu.sh installs on a GPU machine that lacks them (it has no network), into
# benchmarks/wheels/ (ignored by git; carry that folder to the machine, about 15 MB). Built for the machine's
# Python (default 3.12, what the lent H200 machines run; GPU_PYTHON=3.11), manylinux x86_64, at the versions of
# requirements/ci.txt (the set CI tests):
#   - vlfit's core dependencies that machine's image lacks: simplejpeg (the fast pipeline's libjpeg-turbo decode),
#     datasets with dill and multiprocess (sources and the prepared pipeline), braceexpand (shard patterns);
#   - torchcodec (the gpu extra: device decode's batched nvJPEG). Built against torch's stable ABI, it loads into
#     any torch from 2.11 on, and bundles nvJPEG for CUDA 13: it needs a torch built for CUDA 13 and a driver that
#     runs CUDA 13.
#
#   bash benchmarks/fetch_gpu_wheels.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=${GPU_PYTHON:-3.12}
PY=${PYTHON:-python3}
NAMES=(simplejpeg datasets dill multiprocess braceexpand torchcodec)
WHEELS=()
for name in "${NAMES[@]}"; do
  pin=$(grep -i "^${name}==" "$ROOT/requirements/ci.txt") || { echo "fetch_gpu_wheels.sh: $name is not pinned in requirements/ci.txt" >&2; exit 1; }
  WHEELS+=("$pin")
done
mkdir -p "$ROOT/benchmarks/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$ROOT/benchmarks/wheels" "${WHEELS[@]}"
ls -l "$ROOT/benchmarks/wheels"
