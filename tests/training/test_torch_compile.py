"""``--torch_compile`` trains the same steps as eager (device stage, contrastive loss and FLOP count included), and
with ``--bf16`` on a CPU it compiles the step under bf16 autocast, within bf16's rounding of fp32's losses.

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


def _train(data: str, out: Path, *extra: str, steps: int = STEPS) -> tuple[dict[int, float], float]:
    argv = tiny_train_argv(data, out, "--save_strategy", "no", *extra, steps=steps)
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


# Compiled bf16 against eager fp32, step by step: bf16 rounds each matrix product's inputs to 8 mantissa bits, which
# moved the tiny preset's losses by about 0.1% here; ten times that is the tolerance, over four steps.
BF16_LOSS_TOLERANCE = 0.01
BF16_STEPS = 4


def test_compiled_bf16_training_stays_within_tolerance_of_fp32(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    fp32_losses, _ = _train(synthetic_dataset_dir, tmp_path / "fp32", steps=BF16_STEPS)
    torch._dynamo.reset()
    counters.clear()
    compiled = ("--torch_compile", "true", "--torch_compile_backend", "aot_eager")
    bf16_losses, _ = _train(synthetic_dataset_dir, tmp_path / "compiled-bf16", "--bf16", *compiled, steps=BF16_STEPS)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert sorted(bf16_losses) == list(range(1, BF16_STEPS + 1))
    assert bf16_losses != fp32_losses  # the compiled graph computed in bf16 (autocast was traced into it)
    assert bf16_losses == pytest.approx(fp32_losses, rel=BF16_LOSS_TOLERANCE)
    torch._dynamo.reset()
