"""``benchmarks/naflex_loader.py`` runs at a tiny size: every pipeline it compares makes batches, and the record it
writes holds the numbers the docs quote (rates, ratios, padding waste) and the command that reruns it."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import run_benchmark_script

pytestmark = pytest.mark.slow


def test_the_naflex_loader_benchmark_measures_every_pipeline(tmp_path, monkeypatch, capsys):
    results = tmp_path / "naflex_loader.json"
    argv = ["--images", "8", "--batch_size", "4", "--workers", "1", "--repeats", "1", "--max_num_patches", "16"]
    run_benchmark_script("naflex_loader.py", [*argv, "--results", str(results)], monkeypatch)
    record = json.loads(results.read_text())
    rates = {name: run["images_per_s"] for name, run in record["results"].items()}
    assert set(rates) == {"vlfit", "vlfit_uint8_batches", "vlfit_decode_margin_1", "processor", "floor"}
    assert all(rate > 0 for rate in rates.values()), rates
    assert record["ratios"]["vs_processor"] == pytest.approx(rates["vlfit"] / rates["processor"], rel=0.01)
    assert record["patches_per_image"]["max"] <= 16 and record["images"] == 8
    for batching in record["padding_waste"].values():  # a batch padded to its longest image wastes no more
        assert 0 <= batching["padded_to_batch_longest"] <= batching["padded_to_budget"] < 1
    assert record["command"].startswith("python benchmarks/naflex_loader.py --images 8 ")
    assert "vlfit / processor" in capsys.readouterr().out
