#!/usr/bin/env bash
# Fetch the wheels benchmarks/gpu.sh installs on a GPU machine that lacks them (it has no network), into
# benchmarks/wheels/ (ignored by git; carry that folder to the machine, about 10 MB). Built for the machine's
# Python (default 3.12; GPU_PYTHON=3.11), manylinux x86_64:
#   - simplejpeg, so the fast pipeline decodes with libjpeg-turbo there as it does here;
#   - torchcodec, so device decode uses the decoder vlfit declares (else it falls back to torchvision's deprecated
#     decode_jpeg). The wheel is built against torch's stable ABI, so it loads into any torch from 2.11 on, and it
#     bundles nvJPEG for CUDA 13: it needs a torch built for CUDA 13 (cu130) and a driver that runs CUDA 13.
#
#   bash benchmarks/fetch_gpu_wheels.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=${GPU_PYTHON:-3.12}
PY=${PYTHON:-python3}
# Keep torchcodec at the version pyproject.toml declares.
WHEELS=("simplejpeg==1.9.0" "torchcodec==0.17.0")
mkdir -p "$ROOT/benchmarks/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$ROOT/benchmarks/wheels" "${WHEELS[@]}"
ls -l "$ROOT/benchmarks/wheels"
