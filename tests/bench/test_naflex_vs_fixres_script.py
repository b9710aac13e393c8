"""``benchmarks/naflex_vs_fixres.py`` runs at a tiny size (``siglip2-tiny`` against ``siglip-tiny``, 16 patches each):
both models train and load through ``vlfit bench``, the ratios are the medians', and the record names the command that
reruns it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_naflex_against_fixres_benchmark_measures_both_models(tmp_path):
    results = tmp_path / "naflex_vs_fixres.json"
    argv = ["--naflex_preset", "siglip2-tiny", "--fixres_preset", "siglip-tiny", "--max_num_patches", "16",
            "--rounds", "1", "--batch_size", "4", "--workers", "1", "--steps", "2", "--warmup_steps", "1",
            "--num_samples", "8", "--min_long_side", "160", "--max_long_side", "320"]  # fmt: skip
    done = subprocess.run([sys.executable, "benchmarks/naflex_vs_fixres.py", *argv, "--results", str(results)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(results.read_text())
    assert "at most 16 patches" in record["models"]["naflex"] and "64 px" in record["models"]["fixres"]
    for kind in ("naflex", "fixres"):
        assert all(value > 0 for value in record["medians"][kind].values()), record["medians"]
    train = record["medians"]["naflex"]["train_samples_per_s"] / record["medians"]["fixres"]["train_samples_per_s"]
    assert record["naflex_over_fixres"]["train_samples_per_s"] == pytest.approx(train, rel=0.01)
    assert record["command"].startswith("python benchmarks/naflex_vs_fixres.py --naflex_preset siglip2-tiny ")
