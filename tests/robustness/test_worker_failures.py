"""No DataLoader worker dies silently: a crashed or killed worker surfaces as an error naming it, in a plain
DataLoader and in a ``vlfit train`` run, which stops with that error instead of hanging."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
from torch.utils.data import DataLoader, Dataset

from tests.training.train_runs import tiny_train_argv
from vlfit.cli import main
from vlfit.data.loader_workers import broken_loader_iterators
from vlfit.data.pipeline import InputPipeline, handed_over_batches

REPO = Path(__file__).resolve().parents[2]


class DyingDataset(Dataset):
    """Samples are their index; reading ``die_at`` ends the worker process the way ``how`` says."""

    def __init__(self, die_at: int, how: str) -> None:
        self.die_at = die_at
        self.how = how

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> int:
        if index == self.die_at:
            if self.how == "exit":
                os._exit(3)  # e.g. a native library calling exit()
            os.kill(os.getpid(), signal.SIGKILL)  # e.g. the kernel's OOM killer
        return index


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "message"),
    [
        # Depending on which check sees it first: torch's SIGCHLD handler ("pid N") or the queue's liveness check
        # ("pid(s) N"); in CI the handler was first once in the exit case too.
        ("exit", r"DataLoader worker \(pid(\(s\))? \d+\) exited unexpectedly"),
        ("kill", r"DataLoader worker \(pid(\(s\))? \d+\) (is killed by signal: Killed|exited unexpectedly)"),
    ],
)
def test_dead_worker_is_an_error_naming_it(how: str, message: str) -> None:
    # In a process of its own: torch's SIGCHLD handler may raise the error again after the loop has seen it,
    # wherever that process is then; in a test worker, once inside pytest's own reporting (an internal error).
    done = subprocess.run([sys.executable, "-m", "tests.robustness.test_worker_failures", how], cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.fullmatch(f"RuntimeError: {message}.*", done.stdout.strip(), flags=re.S), done.stdout


def iterate_until_a_worker_dies(how: str) -> str:
    """The error a plain DataLoader raises when its worker dies the way ``how`` says (``exit`` or ``kill``)."""
    # Batches as plain lists: a tensor batch travels as a descriptor the main process fetches from its worker, and
    # one fetched from the worker that has just died is an EOFError before the loader can see the death.
    batches = iter(DataLoader(DyingDataset(die_at=9, how=how), batch_size=4, num_workers=2, collate_fn=list))
    try:
        for _ in batches:
            pass
    except RuntimeError as error:
        return f"RuntimeError: {error}"
    finally:
        # The surviving worker stopped here, not by the iterator's finalizer at interpreter exit, where a queue
        # already closed raised EOFError with nowhere to print it (exit code 1 after the right answer).
        batches._shutdown_workers()
    return "no error"


def test_exception_in_worker_names_the_worker() -> None:
    class Failing(DyingDataset):
        def __getitem__(self, index: int) -> Any:
            raise KeyError(f"no row {index}")

    batches = iter(DataLoader(Failing(0, ""), batch_size=2, num_workers=2))
    with pytest.raises(KeyError, match=r"Caught KeyError in DataLoader worker process \d"):
        next(batches)
    # Its workers stopped now (what the iterator does when it is used up): a garbage collection in a later test
    # would finalize their queues before telling them to stop, and wait 5 s for each.
    batches._shutdown_workers()


def test_a_worker_dying_while_it_hands_over_a_batch_is_named_as_such() -> None:
    # What torch raises when the main process fetches a batch's tensors from a worker that is exiting but not yet
    # seen dead (about 1 run in 30 of the test above): the connection to the worker's descriptor sharer ends.
    def batches():
        yield "first"
        raise EOFError

    handed = handed_over_batches(batches())
    assert next(handed) == "first"
    with pytest.raises(RuntimeError, match=r"^a DataLoader worker exited unexpectedly while handing over a batch "
                       r"\(EOFError\): .* rerun with --dataloader_num_workers 0") as error:  # fmt: skip
        next(handed)
    assert isinstance(error.value.__cause__, EOFError)


# SIGKILL only: both ways of dying reach the training loop as the same DataLoader error (checked above).
@pytest.mark.slow
def test_train_fails_naming_the_dead_worker(tmp_path: Path, synthetic_dataset_dir: str, monkeypatch) -> None:
    """A worker of a `vlfit train` run killed mid-epoch: the run stops with the DataLoader's error naming it."""
    victim = datasets.load_from_disk(synthetic_dataset_dir)["train"][5]["instance_id"]  # read in the first epoch
    build = InputPipeline.image_transform

    def dying_transform(self: InputPipeline, *, train: bool):
        transform = build(self, train=train)

        def dying(data: bytes, sample_id: str = "?"):
            if sample_id == victim and multiprocessing.parent_process() is not None:  # only in the worker
                os.kill(os.getpid(), signal.SIGKILL)
            return transform(data, sample_id)

        return dying

    monkeypatch.setattr(InputPipeline, "image_transform", dying_transform)
    argv = tiny_train_argv(synthetic_dataset_dir, tmp_path / "run", "--save_strategy", "no", steps=20, workers=2)
    # The third: the main process fetched the batch's shared memory from the worker while it was exiting.
    dead = (r"DataLoader worker \(pid(\(s\))? \d+\) (exited unexpectedly|is killed by signal: Killed)"
            r"|a DataLoader worker exited unexpectedly while handing over a batch")  # fmt: skip
    with pytest.raises(RuntimeError, match=dead):  # a hang would stop the suite's timeout, not pass
        main(["train", *argv])
    # Nothing left for torch's SIGCHLD handler to raise again from whatever code runs next, even where the error
    # came from the handler in the middle of a step (the traceback then misses the loader's frames).
    assert broken_loader_iterators() == []


if __name__ == "__main__":
    print(iterate_until_a_worker_dies(sys.argv[1]))
