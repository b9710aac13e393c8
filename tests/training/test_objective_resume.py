"""Resume under the other objectives: a run of ``--objective contrastive+itm`` (whose negatives are drawn per step),
one of ``--task vqa`` (whose answer vocabulary is built from the data again) and one with ``--bf16_weights`` (whose
fp32 master weights are what the checkpoint holds) continued from a checkpoint log the losses of the run that never
stopped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.training.train_runs import logged_losses, single_torch_thread, tiny_train_argv
from vlfit.cli import main

pytestmark = pytest.mark.slow

STEPS = 4
CHECKPOINT_STEP = 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():  # bit-identical losses need the same kernels in both runs
        yield


@pytest.fixture(scope="module")
def vqa_dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vlfit.commands.make_data import main as make_data

    data = tmp_path_factory.mktemp("vqa") / "data"
    make_data(["--task", "vqa", "--output_dir", str(data), "--num_samples", "60", "--min_long_side", "64",
               "--max_long_side", "96", "--num_proc", "1"])  # fmt: skip
    return str(data)


@pytest.mark.parametrize("objective", ["contrastive+itm", "vqa", "bf16_weights"])
def test_a_resumed_run_logs_the_losses_of_the_uninterrupted_one(
    objective: str, tmp_path: Path, synthetic_dataset_dir: str, vqa_dataset_dir: str
) -> None:
    data, flags = (vqa_dataset_dir, ["--task", "vqa"]) if objective == "vqa" else (
        synthetic_dataset_dir, ["--objective", objective])  # fmt: skip
    if objective == "bf16_weights":  # the bf16 weights come back from the checkpoint's fp32 ones, as they were
        flags = ["--bf16", "--bf16_weights"]
    straight = tmp_path / "straight"
    saving = ["--save_strategy", "steps", "--save_steps", str(CHECKPOINT_STEP)]
    assert main(["train", *tiny_train_argv(data, straight, *flags, *saving, steps=STEPS)]) == 0
    checkpoint = straight / f"checkpoint-{CHECKPOINT_STEP}"
    assert checkpoint.is_dir()

    resumed = tmp_path / "resumed"
    resume = ["--resume_from_checkpoint", str(checkpoint), "--save_strategy", "no"]
    assert main(["train", *tiny_train_argv(data, resumed, *flags, *resume, steps=STEPS)]) == 0
    before, after = logged_losses(straight), logged_losses(resumed)
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in range(CHECKPOINT_STEP + 1, STEPS + 1):
        assert after[step] == pytest.approx(before[step], abs=1e-6), step
