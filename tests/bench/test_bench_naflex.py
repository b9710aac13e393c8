"""``vlfit bench`` on a SigLIP 2 NaFlex preset: the fast and the prepared pipelines both feed patch batches, the
prepared copy holding each image at its patch grid."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.bench_runs import TINY, run_bench

pytestmark = pytest.mark.slow


def test_the_loader_sweep_runs_both_pipelines_on_patch_batches(tmp_path: Path):
    flags = [*TINY, "--model_preset", "siglip2-tiny", "--mode", "loader", "--pipelines", "fast,prepared",
             "--workers", "0", "--profile_batches", "0", "--no_png"]  # fmt: skip
    code, results, printed = run_bench(tmp_path / "bench", *flags)
    assert code == 0, printed
    assert results is not None
    measured = {row["pipeline"] for row in results["rows"] if row["samples_per_second"] and not row["error"]}
    assert measured == {"fast", "prepared"}
