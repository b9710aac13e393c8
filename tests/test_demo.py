"""``vlfit demo``: ``--quick`` (the same run at a first-look size), and a SIGTERM during training, which saves a
checkpoint and ends with one line naming the command that resumes (exit 143, no traceback)."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vlfit.cli import main
from vlfit.commands.demo import QUICK, parse_arguments, stopped_message
from vlfit.training.preemption import TrainingPreempted

REPO = Path(__file__).resolve().parents[1]
# A demo on the tiny preset that trains long enough to be stopped: 32 training samples, 4 steps an epoch, 40 steps;
# the demo logs every 20 steps.
TINY = ["--num_samples", "40", "--model_preset", "tiny", "--num_train_epochs", "10", "--per_device_train_batch_size",
        "8", "--eval_pool_size", "4", "--dataloader_num_workers", "0", "--min_long_side", "64", "--max_long_side",
        "128"]  # fmt: skip
TRAINING_STARTED_TIMEOUT = 240  # seconds until the first loss line, far above what it takes


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
    assert main(["demo", "--quick", "--output_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vlfit demo: preset tiny, 500 synthetic samples, 40 epochs at batch 32, fast pipeline" in out
    recall = float(re.search(r"text->image recall@1: ([0-9.]+) +\(chance 0\.020, pool of 50\)", out).group(1))
    assert recall >= 0.1  # 0.200 on 2 cores: it learns, well above chance, in its minute
    assert "matching accuracy" in out and "training throughput" in out


def _demo_until_training(argv: list[str]) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """``vlfit demo`` in a child process, returned once it has printed its first training loss (bounded)."""
    proc = subprocess.Popen([sys.executable, "-m", "vlfit", "demo", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                    "OMP_NUM_THREADS": "1"})  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    err: list[str] = []
    stderr_reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    stderr_reader.start()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + TRAINING_STARTED_TIMEOUT
    try:
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                raise AssertionError("the demo ended before training logged a loss")
            if line.startswith("{'loss'"):  # the Trainer's log line (the demo disables tqdm)
                return proc, err, stderr_reader
    except BaseException:
        proc.kill()
        proc.wait()
        stderr_reader.join(timeout=10)
        raise AssertionError("".join(err)[-3000:]) from None


@pytest.mark.slow
def test_sigterm_saves_and_prints_one_line_with_the_command_that_resumes(tmp_path, capsys) -> None:
    argv = ["--output_dir", str(tmp_path), *TINY]
    proc, err, stderr_reader = _demo_until_training(argv)
    proc.send_signal(signal.SIGTERM)  # as `kill PID` or a scheduler sends it
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr_reader.join(timeout=10)
    stderr = "".join(err)
    assert proc.returncode == 143, stderr[-3000:]
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
