"""``vlfit demo``: ``--quick`` (the same run at a first-look size), and a SIGTERM during training, which saves a
checkpoint and ends with one line naming the command that resumes (exit 143, no traceback); a SIGTERM or Ctrl-C
during data generation or the final evaluation ends at once, with one line saying what was kept and the command
that carries on."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.training.train_runs import single_torch_thread
from vlfit.cli import main
from vlfit.commands import demo
from vlfit.commands.demo import QUICK, parse_arguments, stopped_message
from vlfit.commands.demo_stops import DemoStopped, StopSignals
from vlfit.training.preemption import TrainingPreempted

REPO = Path(__file__).resolve().parents[1]
# A demo on the tiny preset that trains long enough to be stopped: 32 training samples, 4 steps an epoch, 40 steps;
# the demo logs every 20 steps.
TINY = ["--num_samples", "40", "--model_preset", "tiny", "--num_train_epochs", "10", "--per_device_train_batch_size",
        "8", "--eval_pool_size", "4", "--dataloader_num_workers", "0", "--min_long_side", "64", "--max_long_side",
        "128"]  # fmt: skip
STARTED_TIMEOUT = 240  # seconds until the line a test waits for, far above what it takes
STOPPED_TIMEOUT = 120  # seconds from the signal to the end of the demo and of every process it started


def test_quick_sets_the_quick_sizes_where_no_flag_set_them() -> None:
    quick = parse_arguments(["--quick"])
    assert {name: getattr(quick, name) for name in QUICK} == QUICK
    assert quick.learning_rate == 5e-4 and quick.image_pipeline == "fast"  # the rest of the recipe as it is
    given = parse_arguments(["--quick", "--num_samples", "80", "--output_dir", "elsewhere"])
    assert (given.num_samples, given.output_dir, given.max_long_side) == (80, "elsewhere", QUICK["max_long_side"])
    assert parse_arguments([]).num_samples == 3000


def test_the_stop_line_names_the_command_that_resumes() -> None:
    stop = TrainingPreempted(signal.SIGTERM, "runs/demo-quick/model/checkpoint-12", 12)
    line = stopped_message(stop, ["--quick", "--resume_from_checkpoint", "old/checkpoint-3"])
    assert "\n" not in line and stop.exit_code == 143
    assert line.startswith("stopped by SIGTERM, checkpoint saved in runs/demo-quick/model/checkpoint-12; to resume: ")
    assert line.endswith("demo --quick --resume_from_checkpoint runs/demo-quick/model/checkpoint-12")
    unsaved = stopped_message(TrainingPreempted(signal.SIGINT, None, 0), ["--quick"])
    assert unsaved.startswith("stopped by SIGINT before a checkpoint was saved; to start again: ")


@pytest.mark.slow
def test_quick_runs_and_prints_the_table(tmp_path, capsys) -> None:
    with single_torch_thread():  # two threads on a loaded machine took 468 s here, one 44 s
        assert main(["demo", "--quick", "--output_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vlfit demo: preset tiny, 500 synthetic samples, 40 epochs at batch 32, fast pipeline" in out
    recall = float(re.search(r"text->image recall@1: ([0-9.]+) +\(chance 0\.020, pool of 50\)", out).group(1))
    assert recall >= 0.1  # 0.200 on 2 cores: it learns, well above chance, in its minute
    assert "matching accuracy" in out and "training throughput" in out


@dataclass
class Demo:
    """A ``vlfit demo`` child process, its stderr lines as read so far, and the threads reading its output."""

    proc: subprocess.Popen
    err: list[str]
    readers: list[threading.Thread]


def _demo_until(argv: list[str], started: Callable[[str], bool]) -> Demo:
    """``vlfit demo`` in a child process (a session of its own, as a terminal's job), returned once a line of its
    stdout or stderr satisfies ``started`` (bounded)."""
    proc = subprocess.Popen([sys.executable, "-m", "vlfit", "demo", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    err: list[str] = []

    def pump(stream: Any, keep: list[str] | None) -> None:
        for line in stream:
            lines.put(line)
            if keep is not None:
                keep.append(line)
        lines.put(None)

    readers = [threading.Thread(target=pump, args=(stream, keep), daemon=True)
               for stream, keep in ((proc.stdout, None), (proc.stderr, err))]  # fmt: skip
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + STARTED_TIMEOUT
    ended = 0
    try:
        while ended < 2:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                ended += 1
            elif started(line):
                return Demo(proc, err, readers)
        raise AssertionError("the demo ended before the line the test waits for")
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the demo and what it started
        proc.wait()
        raise AssertionError("".join(err)[-3000:]) from None


def _stop(demo: Demo, signum: int, *, whole_group: bool = False) -> str:
    """Send ``signum`` to the demo (to its whole process group, as Ctrl-C in a terminal does, with
    ``whole_group``) and wait until it has ended and no process it started holds its output open; its stderr."""
    proc = demo.proc
    if whole_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)  # as `kill PID` or a scheduler sends it
    deadline = time.monotonic() + STOPPED_TIMEOUT
    try:
        proc.wait(timeout=STOPPED_TIMEOUT)
        for reader in demo.readers:
            reader.join(timeout=max(deadline - time.monotonic(), 0.1))
        assert not any(reader.is_alive() for reader in demo.readers), "a process the demo started outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left
    return "".join(demo.err)


@pytest.mark.slow
def test_sigterm_saves_and_prints_one_line_with_the_command_that_resumes(tmp_path, capsys) -> None:
    argv = ["--output_dir", str(tmp_path), *TINY]
    demo = _demo_until(argv, lambda line: line.startswith("step "))  # a logging step's line (tqdm is disabled)
    stderr = _stop(demo, signal.SIGTERM)
    assert demo.proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("vlfit demo: stopped by SIGTERM, checkpoint saved in "), stderr[-3000:]
    command = shlex.split(last.split("; to resume: ", 1)[1])
    assert command[:2] == ["vlfit", "demo"] and command[2:-2] == argv and command[-2] == "--resume_from_checkpoint"
    checkpoint = Path(command[-1])
    assert checkpoint.parent == tmp_path / "model" and (checkpoint / "trainer_state.json").is_file()

    assert main(command[1:]) == 0  # the printed command resumes and finishes the run
    out = capsys.readouterr().out
    assert "reusing synthetic data" in out and "text->image recall@1" in out


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "whole_group"), [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_stop_during_data_generation_is_one_line_with_the_command_that_starts_again(tmp_path, signum, whole_group):
    """The generation workers stop with the demo (none is left holding its output open), and
    Ctrl-C, which reaches every process of the group, prints no worker's traceback."""
    argv = ["--output_dir", str(tmp_path), "--model_preset", "tiny"]  # 3000 samples: a minute or more to generate
    demo = _demo_until(argv, lambda line: line.startswith("generating 3000 synthetic samples"))
    stderr = _stop(demo, signum, whole_group=whole_group)
    assert demo.proc.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"vlfit demo: stopped by {name} while generating the synthetic data (nothing kept); to "
                           "start again: "), stderr[-3000:]  # fmt: skip
    assert shlex.split(last.split("; to start again: ", 1)[1]) == ["vlfit", "demo", *argv]
    assert not (tmp_path / "data" / "vlfit_synthetic_config.json").exists()  # a rerun generates it again


@pytest.mark.slow
def test_a_sigterm_during_the_final_evaluation_names_the_saved_model_and_the_command_that_evaluates_it(
    tmp_path, capsys
):
    # 100 test samples: some seconds of evaluation; 0.02 epochs of the 800 training samples at batch 8: 2 steps.
    argv = ["--output_dir", str(tmp_path), "--model_preset", "tiny", "--num_samples", "1000", "--min_long_side", "64",
            "--max_long_side", "128", "--num_train_epochs", "0.02", "--per_device_train_batch_size", "8",
            "--eval_pool_size", "10"]  # fmt: skip
    demo = _demo_until(argv, lambda line: "evaluating on 100 samples" in line)
    stderr = _stop(demo, signal.SIGTERM)
    assert demo.proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    model = tmp_path / "model"
    assert last.startswith(f"vlfit demo: stopped by SIGTERM during the final evaluation (the trained model is saved "
                           f"in {model}); to evaluate it: "), stderr[-3000:]  # fmt: skip
    command = shlex.split(last.split("; to evaluate it: ", 1)[1])
    assert command[:2] == ["vlfit", "eval"]
    assert main(command[1:]) == 0  # the printed command evaluates the saved model
    assert "eval_t2i_recall@1" in capsys.readouterr().out


def test_a_stop_whose_exception_a_finalizer_dropped_is_raised_again_and_not_printed(monkeypatch) -> None:
    # Python drops an exception raised while a finalizer (or an at-fork callback) runs, as the stop's can be when
    # the signal comes during a garbage collection or as a loader forks: the demo asks again after generating and
    # after training, and the drop is not printed as "Exception ignored ... Traceback"; other drops still are.
    class Finalized:
        def __init__(self, error: BaseException | None = None) -> None:
            self.error = error

        def __del__(self) -> None:
            if self.error is not None:
                raise self.error
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs here, inside the finalizer

    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_value))
    with StopSignals() as stops:
        Finalized()  # collected at once: DemoStopped raised in __del__ and dropped
        Finalized(ValueError("a finalizer's own error"))
        assert stops.received == signal.SIGTERM
        with pytest.raises(DemoStopped, match="SIGTERM"):
            stops.raise_if_received()
    assert [type(error) for error in reported] == [ValueError]
    assert sys.unraisablehook is not stops._report_unraisable  # given back on the way out


# What a finished demo's run returned (the numbers format_summary prints).
RESULTS = {"train_samples_per_second": 812.5, "train_data_wait_share": 0.02, "eval_t2i_recall@1": 0.2,
           "eval_chance_recall@1": 0.02, "eval_pool_size": 50, "eval_i2t_recall@1": 0.18, "eval_t2i_recall@5": 0.5,
           "eval_matching_accuracy": 0.4}  # fmt: skip


@pytest.fixture
def no_training(monkeypatch) -> list[Any]:
    """``run`` replaced by one that records its training arguments and returns ``RESULTS``: the tests below check
    what the demo decides about its folder, not the training."""
    calls: list[Any] = []

    def run(model_args, data_args, training_args):
        calls.append(training_args)
        return dict(RESULTS)

    monkeypatch.setattr(demo, "run", run)
    monkeypatch.setattr(demo, "ensure_synthetic_data", lambda path, config, stops=None: path)
    return calls


def _finished_demo(folder: Path, argv: list[str]) -> list[str]:
    """``folder`` as a finished demo run with ``argv`` leaves it; returns the demo's command line."""
    argv = ["--quick", "--output_dir", str(folder), *argv]
    args = parse_arguments(argv)
    (folder / "model").mkdir(parents=True)
    (folder / "data").mkdir()
    demo.write_demo_record(args, RESULTS)
    return argv


def test_a_finished_demo_run_again_says_it_is_complete_and_how_to_start_again(tmp_path, no_training, capsys):
    argv = _finished_demo(tmp_path / "demo-quick", [])
    assert main(["demo", *argv, "--dataloader_num_workers", "0"]) == 0  # a neutral flag changed: the same demo
    out = capsys.readouterr().out
    assert not no_training  # nothing trained
    folder = tmp_path / "demo-quick"
    assert out.splitlines()[0] == (
        f"vlfit demo: the demo in {folder} is complete, nothing trained (its results: {folder / 'demo.json'}, its "
        f"model: {folder / 'model'}); to start again, remove {folder} or pass another --output_dir"
    )
    assert "text->image recall@1: 0.200   (chance 0.020, pool of 50)" in out


def test_a_demo_folder_with_other_flags_or_other_files_is_refused_in_one_line(tmp_path, no_training, capsys):
    argv = _finished_demo(tmp_path / "demo-quick", [])
    assert main(["demo", *argv, "--num_samples", "80"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"vlfit demo: error: --output_dir {tmp_path / 'demo-quick'} holds a finished demo made "
                           "with other flags (--num_samples 80 (was 500)): ")  # fmt: skip
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "photo.jpg").write_bytes(b"\xff\xd8")
    assert main(["demo", "--quick", "--output_dir", str(mine)]) == 2
    assert f"--output_dir {mine} is not empty (photo.jpg) and vlfit demo did not write it" in capsys.readouterr().err
    assert not no_training and sorted(p.name for p in mine.iterdir()) == ["photo.jpg"]


def test_a_stopped_demo_run_again_resumes_from_its_checkpoint_and_then_is_complete(tmp_path, no_training, capsys):
    folder = tmp_path / "demo-quick"
    argv = ["--quick", "--output_dir", str(folder)]
    (folder / "model" / "checkpoint-12").mkdir(parents=True)  # what a stop during training saved
    (folder / "data").mkdir()
    demo.write_demo_record(parse_arguments(argv))  # written when the stopped demo started
    assert main(["demo", *argv]) == 0
    (training,) = no_training
    assert training.resume_from_checkpoint == str(folder / "model" / "checkpoint-12")
    assert f"resuming the stopped demo from {folder / 'model' / 'checkpoint-12'}" in capsys.readouterr().out
    assert json.loads((folder / "demo.json").read_text())["results"]["eval_t2i_recall@1"] == 0.2
    assert main(["demo", *argv]) == 0 and len(no_training) == 1
    assert "is complete, nothing trained" in capsys.readouterr().out
