"""``--torch_compile`` trains the same steps as eager (device stage, contrastive loss and FLOP count included).

The backend is ``aot_eager``: dynamo's graph capture and AOTAutograd's joint forward/backward graph, as with
inductor, without inductor's code generation (minutes for even the tiny preset on 2 cores). ``vlfit bench
--compare_compile`` measures what inductor gains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tests.training.train_runs import logged_losses, single_torch_thread, tiny_train_argv
from vlfit.cli import main

pytestmark = pytest.mark.slow

STEPS = 2


def _train(data: str, out: Path, *extra: str) -> tuple[dict[int, float], float]:
    argv = tiny_train_argv(data, out, "--save_strategy", "no", *extra, steps=STEPS)
    with single_torch_thread():
        assert main(["train", *argv]) == 0
    results = json.loads((out / "train_results.json").read_text())
    return logged_losses(out), results["train_flops_per_sample"]


def test_compiled_training_matches_eager(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    eager_losses, eager_flops = _train(synthetic_dataset_dir, tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled_losses, compiled_flops = _train(
        synthetic_dataset_dir, tmp_path / "compiled", "--torch_compile", "true", "--torch_compile_backend", "aot_eager"
    )
    assert counters["stats"]["unique_graphs"] >= 1  # the model really ran compiled
    assert not counters["graph_break"], dict(counters["graph_break"])  # in one graph
    assert sorted(eager_losses) == list(range(1, STEPS + 1))
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert compiled_flops == pytest.approx(eager_flops, rel=1e-6)
    torch._dynamo.reset()
