#!/usr/bin/env bash
# Everything vlfit checks on one NVIDIA GPU, in one run: first the CUDA tests (nvJPEG decode against the CPU
# decoder, outputs not overwritten by the next batch, the side-stream prefetcher, a bench sweep with device
# decode), then the throughput study: BridgeTower-large shapes (random init), bf16, batch 48, contrastive
# training steps, for the reference, fast and device pipelines x 0/1/2 DataLoader workers, plus the compute
# ceiling (with eager and with fused attention), the per-stage breakdown and the recommended settings. Writes
# cuda_tests.log, bench.json, bench.md, bench.png and bench.log to OUT_DIR. Runs from this checkout (no install)
# and needs no network.
#
#   bash benchmarks/gpu.sh OUT_DIR
#
# Needs: python3 with torch (CUDA build, GPU visible) and vlfit's core dependencies (pyproject.toml); pytest for
# the CUDA tests (else they are skipped, and the log says so). The lent GPU machines lack some of them and have no
# network: `bash benchmarks/fetch_gpu_wheels.sh` puts wheels of those (simplejpeg, datasets, dill, multiprocess,
# braceexpand, and torchcodec for device decode) for their Python 3.12 in benchmarks/wheels/; they are installed
# into a temporary folder first, one by one, without touching the machine's packages.
#
# Time: about 5-6 minutes on an H100-class GPU with 16 cores (an estimate: not yet run on one). The CUDA tests
# are stopped after VLFIT_GPU_TESTS_BUDGET_S seconds (default 90) and the sweep after VLFIT_BENCH_BUDGET_S
# (default 360), so the whole script stays under 8 minutes; an interrupted sweep still writes what it measured
# (bench.json has "complete": false).
#
# Environment: PYTHON (default python3); VLFIT_GPU_TESTS=0 skips the CUDA tests; VLFIT_GPU_TESTS_BUDGET_S;
# VLFIT_BENCH_BUDGET_S; VLFIT_BENCH_ARGS (replaces the sweep flags below); VLFIT_BENCH_ALLOW_CPU=1 runs without a
# GPU (for testing this script only: the CUDA tests then report themselves skipped).
set -euo pipefail

OUT=${1:?usage: bash benchmarks/gpu.sh OUT_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${VLFIT_BENCH_BUDGET_S:-360}
TESTS_BUDGET=${VLFIT_GPU_TESTS_BUDGET_S:-90}
DEFAULT_ARGS="--model_preset large --pipelines reference,fast,device --workers 0,1,2 --mode train --bf16
  --per_device_train_batch_size 48 --steps 10 --warmup_steps 3 --repeats 2 --max_config_seconds 40 --auto
  --compare_attention"
ARGS=${VLFIT_BENCH_ARGS:-$DEFAULT_ARGS}

mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if compgen -G "$ROOT/benchmarks/wheels/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  trap 'rm -rf "$SITE"' EXIT
  # One at a time, so a wheel that does not fit this machine (built for another Python?) keeps no other out.
  for wheel in "$ROOT"/benchmarks/wheels/*.whl; do
    if ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$wheel"; then
      echo "gpu.sh: $(basename "$wheel") does not install here (built for another Python?); going on without it"
    fi
  done
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi

"$PY" - <<'EOF'
import importlib
import os
import sys

# The GPU first: a machine without one is refused before the slow imports below.
import torch

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
if gpu == "none" and os.environ.get("VLFIT_BENCH_ALLOW_CPU") != "1":
    sys.exit("gpu.sh: torch sees no CUDA GPU (set VLFIT_BENCH_ALLOW_CPU=1 to run on the CPU anyway)")
# vlfit's core dependencies, by import name (pyproject.toml); torchcodec is the gpu extra, reported below.
required = ("torchvision", "transformers", "accelerate", "datasets", "tokenizers", "simplejpeg", "PIL", "numpy",
            "pyarrow", "braceexpand", "yaml", "tqdm", "psutil", "matplotlib", "safetensors")
missing = []
for name in required:
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
if missing:
    sys.exit(f"gpu.sh: missing required packages: {', '.join(missing)} (bash benchmarks/fetch_gpu_wheels.sh "
             "fetches wheels of those the GPU machines lack; carry benchmarks/wheels)")
found = {}
for name in ("torchcodec",):
    try:
        module = importlib.import_module(name)
        if name == "torchcodec":
            importlib.import_module("torchcodec.decoders")  # loads its native libraries, nvJPEG included
        found[name] = getattr(module, "__version__", "yes")
    except Exception:  # ImportError, or native libraries that do not load (OSError, RuntimeError)
        found[name] = "no"
print(f"gpu.sh: python {sys.version.split()[0]}, torch {torch.__version__}, GPU {gpu}; gpu extra: "
      + ", ".join(f"{k} {v}" for k, v in found.items()))
EOF

# SIGINT makes vlfit bench stop and write its partial results; SIGKILL follows a minute later if it hangs.
LIMIT=()
TESTS_LIMIT=()
if command -v timeout >/dev/null; then
  LIMIT=(timeout --signal=INT --kill-after=60 "$BUDGET")
  TESTS_LIMIT=(timeout --kill-after=10 "$TESTS_BUDGET")
else
  echo "gpu.sh: no 'timeout' command here: the tests and the sweep run without a time limit"
fi
set +e

# The CUDA-marked tests: the GPU half of what CI (which has no GPU) cannot run. A failure is reported, and the
# sweep still runs: its numbers are wanted either way.
if [ "${VLFIT_GPU_TESTS:-1}" = 1 ]; then
  if "$PY" -c "import pytest" 2>/dev/null; then
    (cd "$ROOT" && ${TESTS_LIMIT[@]+"${TESTS_LIMIT[@]}"} "$PY" -m pytest -m cuda -p no:cacheprovider -rA \
      tests/data/test_device_decode.py tests/data/test_device_stage.py tests/data/test_device_placement.py tests/bench) >"$OUT/cuda_tests.log" 2>&1
    tests_status=$?
    tail -n 15 "$OUT/cuda_tests.log"
    echo "gpu.sh: CUDA tests exit $tests_status (full log: $OUT/cuda_tests.log)"
  else
    echo "gpu.sh: pytest is not installed here: CUDA tests skipped" | tee "$OUT/cuda_tests.log"
  fi
fi

# shellcheck disable=SC2086  # ARGS is a list of flags
${LIMIT[@]+"${LIMIT[@]}"} "$PY" -m vlfit bench --output_dir "$OUT" $ARGS 2>&1 | tee "$OUT/bench.log"
status=${PIPESTATUS[0]}
set -e
case $status in
  0) ;;
  124 | 130) echo "gpu.sh: the sweep was stopped after ${BUDGET} s; partial results are in $OUT" ;;
  *) echo "gpu.sh: vlfit bench failed (exit $status); see $OUT/bench.log" >&2; exit "$status" ;;
esac
for name in bench.json bench.md; do
  test -s "$OUT/$name" || { echo "gpu.sh: $OUT/$name was not written" >&2; exit 1; }
done
echo "gpu.sh: wrote $(cd "$OUT" && ls bench.* | tr '\n' ' ')to $OUT"
