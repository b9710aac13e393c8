"""The same ``--seed`` gives the same losses; another seed gives other losses (so the check can fail)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.training.train_runs import logged_losses, single_torch_thread, tiny_train_argv
from vlfit.cli import main

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def _losses(data: str, out: Path, seed: int, *extra: str) -> list[float]:
    argv = tiny_train_argv(data, out, "--save_strategy", "no", *extra, steps=STEPS)
    assert main(["train", *argv, "--seed", str(seed)]) == 0  # the later --seed wins
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return [losses[step] for step in range(1, STEPS + 1)]


def test_same_seed_same_losses_other_seed_other_losses(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    # Random resized crop and flips: the data pipeline's randomness is seeded too, not only weights and order.
    augment = ("--random_resized_crop", "--horizontal_flip", "--dataloader_num_workers", "2")
    first = _losses(synthetic_dataset_dir, tmp_path / "a", 5, *augment)
    second = _losses(synthetic_dataset_dir, tmp_path / "b", 5, *augment)
    other = _losses(synthetic_dataset_dir, tmp_path / "c", 6, *augment)
    assert first == second
    assert all(a != c for a, c in zip(first, other, strict=True))
