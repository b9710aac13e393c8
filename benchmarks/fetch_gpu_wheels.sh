#!/usr/bin/env bash
# Fetch the wheels benchmarks/gpu.sh installs on a GPU machine that lacks them (it has no network), into
# benchmarks/wheels/ (ignored by git; carry that folder to the machine). Today: simplejpeg, so the fast pipeline
# decodes with libjpeg-turbo there as it does here. Built for the machine's Python (default 3.12; GPU_PYTHON=3.11).
#
#   bash benchmarks/fetch_gpu_wheels.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=${GPU_PYTHON:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$ROOT/benchmarks/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$ROOT/benchmarks/wheels" "simplejpeg==1.9.0"
ls -l "$ROOT/benchmarks/wheels"
