"""``vlfit search`` under torchrun (2 gloo processes): every process trains each trial, process 0 talks to the
study, and a pruning decision stops the trial on both processes (otherwise the other one would wait forever in
its next collective)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from tests.search.search_runs import STUDY, load_trials, search_argv, write_space
from tests.training.train_runs import run_torchrun

pytestmark = pytest.mark.slow

TIMEOUT = 240  # a guard against hangs, far above the time the run takes


def test_torchrun_trains_each_trial_on_every_process_and_prunes_on_both(
    tmp_path: Path, synthetic_dataset_dir: str
) -> None:
    out = tmp_path / "search"
    out.mkdir()
    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True}}
    study = optuna.create_study(study_name=STUDY, storage=f"sqlite:///{out / 'search.db'}", direction="maximize")
    study.add_trial(  # an earlier trial with recall@1 = 1 at every evaluation: every new trial falls behind it
        optuna.trial.create_trial(
            params={"learning_rate": 1e-4},
            distributions={"learning_rate": FloatDistribution(1e-5, 1e-2, log=True)},
            value=1.0,
            intermediate_values={2: 1.0, 4: 1.0},
        )
    )
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path, space), "--n_trials", "2")
    argv += ["--pruner", "median", "--pruner_startup_trials", "1", "--per_device_train_batch_size", "4"]
    done = run_torchrun("-m", "vlfit", "search", *argv, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    trials = load_trials(out)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert list(trials[1].intermediate_values) == [2]  # told once, by process 0, at the first evaluation
    # Both processes trained the trial: each wrote its own bad-sample list.
    assert sorted(p.name for p in (out / "trial-1").glob("bad_samples*.jsonl")) == [
        "bad_samples.jsonl", "bad_samples_1.jsonl"
    ]  # fmt: skip
    assert json.loads((out / "search.json").read_text())["finished"] == 2
