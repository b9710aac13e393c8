"""Checkpoints appear atomically: a kill during saving leaves no ``checkpoint-N`` that resuming would take for a
complete one, and the next run resumes from the last complete checkpoint and cleans the partial one up."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from tests.training.train_runs import REPO, logged_losses, single_torch_thread, tiny_train_argv
from vlfit.cli import main
from vlfit.data.batch import BadSample
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.models.loading import load_model
from vlfit.training.trainer import VlfitTrainer

COMPLETE = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")

# Runs `vlfit train` with the Trainer's RNG-state saving (which comes after the model, optimizer and scheduler
# are written) replaced by a SIGKILL on the second checkpoint: the process dies in the middle of that save.
KILL_DURING_SECOND_SAVE = """
import os, signal, sys
from transformers import Trainer
saves = []
original = Trainer._save_rng_state
def save_rng_state(self, output_dir):
    saves.append(output_dir)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, output_dir)
Trainer._save_rng_state = save_rng_state
from vlfit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


@pytest.mark.slow
def test_kill_during_save_leaves_no_checkpoint_that_resume_would_take(
    tmp_path: Path, synthetic_dataset_dir: str
) -> None:
    out = tmp_path / "run"
    argv = tiny_train_argv(synthetic_dataset_dir, out, "--save_steps", "5", steps=12)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SECOND_SAVE, "train", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    partial = out / ".partial-checkpoint-10" / "checkpoint-10"
    assert (partial / "model.safetensors").is_file() and not (partial / "rng_state.pth").exists()  # died mid-save
    assert not (out / "checkpoint-10").exists()
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-5")
    for name in COMPLETE:
        assert (out / "checkpoint-5" / name).is_file(), name

    assert main(["train", *argv]) == 0  # finds checkpoint-5 in the output folder and resumes from it
    assert sorted(logged_losses(out)) == list(range(1, 13))
    assert logged_losses(out, "checkpoint-10/trainer_state.json").keys() == set(range(1, 11))
    assert not (out / ".partial-checkpoint-10").exists()
    for name in COMPLETE:
        assert (out / "checkpoint-10" / name).is_file(), name


def test_same_step_saved_twice_rotation_and_leftovers(tmp_path: Path) -> None:
    bundle = load_model(model_preset="tiny", captions=lambda: ["a cat", "a dog"] * 20)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_total_limit=2)
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), args.device)
    trainer = VlfitTrainer(model=bundle.model, args=args, pipeline=pipeline, family=bundle.family)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    leftover = tmp_path / ".partial-checkpoint-1" / "checkpoint-1"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half a file")
    trainer.bad_samples.add([BadSample("x", "caption is empty")], rows=4, step=2)
    for step in (2, 3, 3, 4):  # step 3 twice: e.g. a stop requested on a step that also saves
        trainer.state.global_step = step
        trainer._save_checkpoint(trainer.model, None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4"]  # rotated to 2, nothing partial left
    for step in (3, 4):
        for name in (*COMPLETE, "bad_samples.json"):
            assert (tmp_path / f"checkpoint-{step}" / name).is_file(), name
    resumed = VlfitTrainer(model=bundle.model, args=args, pipeline=pipeline, family=bundle.family)
    assert resumed.bad_samples.load(str(tmp_path / "checkpoint-4"))
    assert resumed.bad_samples.state_dict() == trainer.bad_samples.state_dict()


def test_a_full_disk_while_saving_ends_in_one_line_naming_the_last_complete_checkpoint(
    tmp_path: Path, synthetic_dataset_dir: str, monkeypatch, capsys
) -> None:
    """The device fills during the second checkpoint (ENOSPC from the Trainer's last write): the run ends with exit 2
    and one line naming the folder, its free space, about what a checkpoint takes and the checkpoint to resume
    from; the partial copy is removed, giving its space back."""
    import errno

    from transformers import Trainer

    saves: list[str] = []
    original = Trainer._save_rng_state

    def save_rng_state(self, output_dir):
        saves.append(output_dir)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(output_dir, "rng_state.pth"))
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", save_rng_state)
    out = tmp_path / "run"
    argv = ["train", *tiny_train_argv(synthetic_dataset_dir, out, "--save_steps", "2", steps=4)]
    with single_torch_thread():
        assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"vlfit train: error: no space left on the device of {out} writing ")
    assert "MB free" in error and "MB needed" in error
    assert f"the last complete checkpoint is {out / 'checkpoint-2'}" in error
    assert not any(entry.startswith(".partial") for entry in os.listdir(out))  # the partial copy's space is back
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_torch_s_own_write_error_on_a_full_device_ends_in_one_line_naming_the_last_complete_checkpoint(
    tmp_path: Path, synthetic_dataset_dir: str, monkeypatch, capsys
) -> None:
    """torch.save loses the errno: writing the second checkpoint's optimizer state into /dev/full (a device that is
    always full) fails in its zip writer (``unexpected pos ...`` or ``basic_ios::clear``, a RuntimeError). The run
    ends with exit 2 and one line, no traceback: the write failed in torch's words, the folder's free space, the
    last complete checkpoint; the partial copy is removed."""
    import torch

    original = torch.save
    redirected: list[str] = []

    def save(obj, f, *args, **kwargs):
        if isinstance(f, str) and f"{os.sep}checkpoint-4{os.sep}" in f:
            redirected.append(f)
            f = "/dev/full"
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "run"
    argv = ["train", *tiny_train_argv(synthetic_dataset_dir, out, "--save_steps", "2", steps=4)]
    capsys.readouterr()
    with single_torch_thread():
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert redirected and "Traceback" not in err
    error = err.strip().splitlines()[-1]
    assert error.startswith(f"vlfit train: error: the write to {out} failed (torch: "), error
    assert "MB free, about " in error and " needed); " in error
    assert error.endswith(f"the last complete checkpoint is {out / 'checkpoint-2'}: free space there or write "
                          "elsewhere (--output_dir)")  # fmt: skip
    assert not any(entry.startswith(".partial") for entry in os.listdir(out))
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
