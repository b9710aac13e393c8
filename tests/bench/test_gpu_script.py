"""``benchmarks/gpu.sh`` on a CPU, its refusal without a GPU, and the CUDA check of the bench itself (run by gpu.sh
on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench.bench_runs import REPO, TINY, assert_png, run_bench

pytestmark = pytest.mark.slow


def test_gpu_script_runs_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Loader mode: the script's plumbing is under test here (the sweep's train rows are test_sweep's).
    args = " ".join(
        [*TINY, "--pipelines", "fast,device", "--workers", "0", "--mode", "loader", "--profile_batches", "0"]
    )
    # The CUDA tests would only report themselves skipped here (test_gpu_script_runs_the_cuda_tests checks which).
    env = {**os.environ, "PYTHON": sys.executable, "VLFIT_BENCH_ALLOW_CPU": "1", "VLFIT_BENCH_ARGS": args,
           "VLFIT_GPU_TESTS": "0"}  # fmt: skip
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    assert results["machine"]["jpeg_decoder"].startswith("simplejpeg")
    assert len(results["rows"]) == 2 and all(row["samples_per_second"] > 0 for row in results["rows"])
    assert_png(out / "bench.png")
    assert (out / "bench.log").stat().st_size > 0
    assert not (out / "cuda_tests.log").exists()


def test_gpu_script_runs_the_cuda_tests() -> None:
    """Every path gpu.sh gives pytest exists and holds CUDA-marked tests, and every CUDA-marked test is among them."""
    script = (REPO / "benchmarks" / "gpu.sh").read_text()
    command = script[script.index("-m pytest -m cuda") :].split(")", 1)[0].split()
    paths = [REPO / word for word in command if word.startswith("tests/")]
    assert paths and all(path.exists() for path in paths)
    listed = {file for path in paths for file in ([path] if path.is_file() else path.rglob("test_*.py"))}
    marked = {file for file in (REPO / "tests").rglob("test_*.py") if "@pytest.mark.cuda" in file.read_text()}
    assert marked and marked <= listed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_script_refuses_to_run_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("VLFIT_BENCH_ALLOW_CPU", None)
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "no CUDA GPU" in done.stderr
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_bench_on_cuda_measures_device_memory_and_device_decode(tmp_path: Path) -> None:
    code, results, _ = run_bench(tmp_path, *TINY, "--pipelines", "fast,device", "--workers", "0,1",
                                 "--device", "cuda")  # fmt: skip
    assert code == 0
    assert results["settings"]["precision"] in ("bf16", "fp32")
    assert results["settings"]["available_memory_from"].startswith("free memory on")
    for row in results["rows"]:
        assert row["error"] is None and row["samples_per_second"] > 0
        assert row["peak_device_memory_mib"] > 0
