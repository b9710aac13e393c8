"""Helpers to run ``vlfit search`` on the tiny preset: flags, a child process signalled in a chosen trial, and
reading the study back from its storage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml

from tests.training.train_runs import REPO

STUDY = "vlfit-search"
# Wide ranges, so that trials differ; learning_rate on a log scale; a training flag and a model flag.
SPACE = {
    "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
    "warmup_steps": {"type": "float", "low": 0.0, "high": 0.2},
    "logit_scale_init_value": {"type": "float", "low": 1.6, "high": 4.6},
}


def write_space(folder: Path, space: dict | None = None) -> Path:
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(space or SPACE))
    return path


def search_argv(data: str, output_dir: Path | str, space: Path | str, *extra: str, steps: int = 4) -> list[str]:
    """``vlfit search`` flags for a short study of CPU trials on the tiny preset, evaluating every 2 steps."""
    return [
        "--model_preset", "tiny", "--dataset_name", data, "--output_dir", str(output_dir), "--report_to", "none",
        "--max_steps", str(steps), "--per_device_train_batch_size", "8", "--logging_steps", "1",
        "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "no",
        "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--seed", "11",
        "--search_space", str(space), *extra,
    ]  # fmt: skip


def load_trials(output_dir: Path | str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, from the SQLite file in ``output_dir``."""
    storage = f"sqlite:///{Path(output_dir).resolve() / 'search.db'}"
    return optuna.load_study(study_name=STUDY, storage=storage).get_trials()


@dataclass
class SignalledSearch:
    returncode: int
    output: str


def search_until_signal(argv: list[str], *, trial: int, timeout: float = 180) -> SignalledSearch:
    """Run ``vlfit search`` in a new process group; SIGTERM the group once trial ``trial`` has logged its first
    training step. Fails (after killing the group) when the search ends first."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlfit", "search", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    in_trial = False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            in_trial = in_trial or f"vlfit - trial {trial}: " in line
            if in_trial and line.startswith("{'loss'"):  # the Trainer prints each step's logs (--disable_tqdm)
                os.killpg(proc.pid, signal.SIGTERM)
                break
        else:
            raise AssertionError(f"the search ended before trial {trial} trained:\n{''.join(lines)[-3000:]}")
        rest, _ = proc.communicate(timeout=timeout)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return SignalledSearch(proc.returncode, "".join(lines))
