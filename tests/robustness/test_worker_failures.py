"""No DataLoader worker dies silently: a crashed or killed worker surfaces as an error naming it, in a plain
DataLoader and in a ``vlfit train`` run, which exits non-zero instead of hanging."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.training.train_runs import REPO, tiny_train_argv


class DyingDataset(Dataset):
    """Samples are their index; reading ``die_at`` ends the worker process the way ``how`` says."""

    def __init__(self, die_at: int, how: str) -> None:
        self.die_at = die_at
        self.how = how

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.die_at:
            if self.how == "exit":
                os._exit(3)  # e.g. a native library calling exit()
            os.kill(os.getpid(), signal.SIGKILL)  # e.g. the kernel's OOM killer
        return torch.tensor(index)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("exit", r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"),
        # Depending on which check sees it first: torch's SIGCHLD handler or the queue's liveness check.
        ("kill", r"DataLoader worker \(pid(\(s\))? \d+\) (is killed by signal: Killed|exited unexpectedly)"),
    ],
)
def test_dead_worker_is_an_error_naming_it(how: str, message: str) -> None:
    loader = DataLoader(DyingDataset(die_at=9, how=how), batch_size=4, num_workers=2)
    with pytest.raises(RuntimeError, match=message):
        for _ in loader:
            pass


def test_exception_in_worker_names_the_worker() -> None:
    class Failing(DyingDataset):
        def __getitem__(self, index: int) -> Any:
            raise KeyError(f"no row {index}")

    with pytest.raises(KeyError, match=r"Caught KeyError in DataLoader worker process \d"):
        next(iter(DataLoader(Failing(0, ""), batch_size=2, num_workers=2)))


# `vlfit train` whose image transform kills its worker process when it reaches one sample.
KILL_WORKER_AT_SAMPLE = """
import os, signal, sys
from vlfit.data.pipeline import InputPipeline
build = InputPipeline.image_transform
def build_dying_transform(self, *, train):
    transform = build(self, train=train)
    def dying(data, sample_id="?"):
        if sample_id == sys.argv[1]:
            if sys.argv[2] == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        return transform(data, sample_id)
    return dying
InputPipeline.image_transform = build_dying_transform
from vlfit.cli import main
sys.exit(main(sys.argv[3:]))
"""


# SIGKILL only: both ways of dying reach the training loop as the same DataLoader error (checked above).
@pytest.mark.parametrize("how", ["kill"])
def test_train_exits_non_zero_naming_the_dead_worker(tmp_path: Path, synthetic_dataset_dir: str, how: str) -> None:
    argv = tiny_train_argv(synthetic_dataset_dir, tmp_path / "run", "--save_strategy", "no", steps=20, workers=2)
    victim = datasets.load_from_disk(synthetic_dataset_dir)["train"][5]["instance_id"]  # read in the first epoch
    done = subprocess.run(
        [sys.executable, "-c", KILL_WORKER_AT_SAMPLE, victim, how, "train", *argv],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,  # a hang fails the test here
    )
    assert done.returncode == 1, done.stderr[-3000:]
    dead = r"RuntimeError: DataLoader worker \(pid(\(s\))? \d+\) (exited unexpectedly|is killed by signal: Killed)"
    assert re.search(dead, done.stderr), done.stderr[-3000:]
