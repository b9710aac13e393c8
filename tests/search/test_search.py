"""``vlfit search`` end to end on the tiny preset: a study writes every output, a study killed by SIGTERM resumes to
the same trial count, the median pruner stops a poor trial at its first evaluation, and bad input stops before any
trial."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState
from PIL import Image
from safetensors.torch import load_file

from tests.search.search_runs import SPACE, STUDY, load_trials, search_argv, write_space
from tests.training.train_runs import SigtermAtStep, single_torch_thread
from vlfit.cli import main
from vlfit.commands.train import parse_arguments
from vlfit.search import objective
from vlfit.training.run import run

pytestmark = pytest.mark.slow

METRIC = "eval_t2i_recall@1"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def _in_space(params: dict[str, float]) -> bool:
    return all(SPACE[name]["low"] <= value <= SPACE[name]["high"] for name, value in params.items())


def test_a_three_trial_study_writes_every_output(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    out = tmp_path / "search"
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path), "--n_trials", "3", "--pruner", "none")
    argv += ["--save_strategy", "steps", "--save_steps", "2"]  # every trial saves checkpoints at steps 2 and 4
    assert main(["search", *argv]) == 0

    trials = load_trials(out)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert len({t.params["learning_rate"] for t in trials}) == 3 and all(_in_space(t.params) for t in trials)
    for trial in trials:  # the metric is the trial's own final evaluation, in its own folder
        assert json.loads((out / f"trial-{trial.number}" / "eval_results.json").read_text())[METRIC] == trial.value
        assert sorted(trial.intermediate_values) == [2, 4]  # reported at each evaluation during training
    best = max(trials, key=lambda t: (t.value, -t.number))

    summary = json.loads((out / "search.json").read_text())
    assert summary["metric"] == METRIC and summary["finished"] == 3
    assert summary["best"]["number"] == best.number and summary["best"]["params"] == best.params
    assert [(t["number"], t["state"], t["value"]) for t in summary["trials"]] == [
        (t.number, "complete", t.value) for t in trials
    ]
    assert all(t["duration_s"] > 0 for t in summary["trials"])
    table = (out / "search.md").read_text()
    assert all(f"\n| {t.number} | complete |" in table for t in trials)

    # best.yaml is a vlfit train flags file: the search's flags with the best trial's values.
    parsed = parse_arguments([str(out / "best.yaml")])
    assert parsed.training.learning_rate == best.params["learning_rate"]
    assert parsed.training.warmup_steps == best.params["warmup_steps"]
    assert parsed.model.logit_scale_init_value == best.params["logit_scale_init_value"]
    assert parsed.model.model_preset == "tiny" and parsed.training.max_steps == 4
    assert Path(parsed.training.output_dir) == out / "best"

    with Image.open(out / "search.png") as image:
        assert image.format == "PNG" and image.width > 500

    # Checkpoints and weights are kept for the best trial only.
    for trial in trials:
        folder = out / f"trial-{trial.number}"
        kept = sorted(p.name for p in folder.glob("checkpoint-*"))
        assert kept == (["checkpoint-2", "checkpoint-4"] if trial.number == best.number else [])
        assert (folder / "model.safetensors").is_file() == (trial.number == best.number)
    # The trial's model started from its logit scale (4 steps of training move it by a few hundredths at most).
    trained = load_file(out / f"trial-{best.number}" / "model.safetensors")["logit_scale"]
    assert float(trained) == pytest.approx(best.params["logit_scale_init_value"], abs=0.1)


def test_a_killed_study_resumes_and_ends_with_n_trials(
    tmp_path: Path, synthetic_dataset_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "search"
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path), "--n_trials", "3", "--pruner", "none")

    def run_with_a_kill_in_trial_1(*args, callbacks=(), **kwargs):
        if Path(args[2].output_dir).name == "trial-1":
            callbacks = [*callbacks, SigtermAtStep(1)]
        return run(*args, callbacks=callbacks, **kwargs)

    monkeypatch.setattr(objective, "run", run_with_a_kill_in_trial_1)
    assert main(["search", *argv]) == 143  # 128 + SIGTERM, as a shell reports a killed process
    assert "SIGTERM stopped the trial in progress, recorded as failed" in capsys.readouterr().err
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the search's handlers are gone
    first = load_trials(out)
    assert [t.state for t in first] == [TrialState.COMPLETE, TrialState.FAIL]
    checkpoint = first[1].user_attrs["checkpoint"]  # the preemption handler saved one at the stop
    assert Path(checkpoint) == (out / "trial-1" / "checkpoint-2").resolve() and Path(checkpoint).is_dir()

    assert main(["search", *argv]) == 0  # the same command again
    trials = load_trials(out)
    states = [t.state for t in trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[0].value == first[0].value and trials[0].params == first[0].params  # kept, not rerun
    # The interrupted trial is continued from its checkpoint by a trial with its parameters.
    assert trials[2].params == first[1].params and trials[2].user_attrs["resumes"] == 1
    assert trials[2].user_attrs["resume_from_checkpoint"] == checkpoint
    assert list(trials[2].intermediate_values) == [4]  # its training went on from step 2
    assert trials[3].params not in (trials[0].params, trials[1].params)  # the sampler does not start over
    summary = json.loads((out / "search.json").read_text())
    assert summary["finished"] == 3 and summary["states"] == {"complete": 3, "fail": 1}
    assert summary["trials"][2]["continues_trial"] == 1
    assert not Path(checkpoint).exists()  # continued and finished: no longer needed


def test_the_median_pruner_stops_a_worse_trial_at_its_first_evaluation(
    tmp_path: Path, synthetic_dataset_dir: str
) -> None:
    out = tmp_path / "search"
    out.mkdir()
    # An earlier trial of the study that scored recall@1 = 1 at every evaluation: the median to beat.
    study = optuna.create_study(study_name=STUDY, storage=f"sqlite:///{out / 'search.db'}", direction="maximize")
    study.add_trial(
        optuna.trial.create_trial(
            params={"learning_rate": 1e-4, "warmup_steps": 0.0},
            distributions={
                "learning_rate": FloatDistribution(1e-5, 1e-2, log=True),
                "warmup_steps": FloatDistribution(0.0, 0.2),
            },
            value=1.0,
            intermediate_values={2: 1.0, 4: 1.0},
        )
    )
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path), "--n_trials", "2", steps=6)
    assert main(["search", *argv, "--pruner", "median", "--pruner_startup_trials", "1"]) == 0

    trials = load_trials(out)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    pruned = trials[1]
    assert list(pruned.intermediate_values) == [2]  # stopped at its first evaluation, of three
    assert pruned.intermediate_values[2] < 1.0
    assert not (out / "trial-1" / "eval_results.json").exists()  # never trained to the end nor evaluated again
    summary = json.loads((out / "search.json").read_text())
    assert summary["trials"][1]["state"] == "pruned" and summary["trials"][1]["last_step"] == 2
    assert summary["finished"] == 2  # a pruned trial counts towards --n_trials
    assert f"| 1 | pruned | ({pruned.intermediate_values[2]:.4g}) |" in (out / "search.md").read_text()


_RANGE = {"type": "float", "low": 1e-5, "high": 1e-3}


@pytest.mark.parametrize(
    ("space", "extra", "message"),
    [
        pytest.param(
            {"learnig_rate": _RANGE}, [],
            "learnig_rate: not a vlfit train field (did you mean learning_rate?); searchable: ", id="unknown-name",
        ),
        pytest.param(
            {"learning_rate": {**_RANGE, "low": 1e-3}}, [],
            "learning_rate: empty or inverted range: low 0.001 must be below high 0.001", id="empty-range",
        ),
        pytest.param(
            {"weight_decay": {"type": "float", "low": 0.1, "high": 0.01}}, [],
            "weight_decay: empty or inverted range: low 0.1 must be below high 0.01", id="inverted-range",
        ),
        pytest.param(
            {"learning_rate": {**_RANGE, "low": 0.0, "log": True}}, [],
            "learning_rate: a log range must stay above 0, got low 0.0", id="log-through-zero",
        ),
        pytest.param(
            SPACE, ["--metric", "t2i_recall@2"],
            "--metric eval_t2i_recall@2: evaluation does not report it; it reports: ", id="unknown-metric",
        ),
        pytest.param(
            SPACE, ["--storage", "sqlite:////no/such/folder/study.db"],
            "--storage sqlite:////no/such/folder/study.db: cannot open the study storage", id="unreachable-storage",
        ),
    ],
)  # fmt: skip
def test_bad_input_stops_before_any_trial_with_one_line(
    tmp_path: Path,
    synthetic_dataset_dir: str,
    capsys: pytest.CaptureFixture[str],
    space: dict,
    extra: list[str],
    message: str,
) -> None:
    out = tmp_path / "search"
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path, space), "--n_trials", "1", *extra)
    assert main(["search", *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("vlfit search: error: ") and message in last, last
    assert not (out / "trial-0").exists()
    if "searchable" in message:
        assert "learning_rate, " in last and "weight_decay" in last  # the valid fields are named
    if "--metric" in message:
        assert "eval_t2i_recall@1, " in last and "eval_matching_accuracy" in last  # the metrics there are


def test_runs_of_another_study_in_the_output_folder_are_refused(
    tmp_path: Path, synthetic_dataset_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "search"
    (out / "trial-0" / "checkpoint-2").mkdir(parents=True)  # a run the (new) study knows nothing of
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path), "--n_trials", "1")
    assert main(["search", *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds runs that are not trials of study 'vlfit-search' (trial-0)" in last, last
    assert (out / "trial-0" / "checkpoint-2").is_dir() and load_trials(out) == []  # nothing removed, nothing run
