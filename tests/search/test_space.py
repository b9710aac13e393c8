"""The search space file: what it accepts, what each parameter suggests, and the one-line errors (no data needed)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from vlfit.search.space import LOGIT_SCALE_PARAMETER, default_space, load_space, parse_space


def test_a_space_file_suggests_each_kind_within_its_range(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(
        "learning_rate: {type: float, low: 1e-5, high: 1e-3, log: true}\n"  # YAML reads 1e-5 as a string
        "gradient_accumulation_steps: {type: int, low: 1, high: 4}\n"
        "lr_scheduler_type: {type: categorical, choices: [linear, cosine]}\n"
    )
    space = load_space(str(path))
    assert space.names == ["learning_rate", "gradient_accumulation_steps", "lr_scheduler_type"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = space.suggest(study.ask())
        assert 1e-5 <= params["learning_rate"] <= 1e-3
        assert params["gradient_accumulation_steps"] in (1, 2, 3, 4)
        assert params["lr_scheduler_type"] in ("linear", "cosine")
    assert parse_space(space.to_dict()).fingerprint() == space.fingerprint()  # the form stored with the study


def test_the_default_space_has_the_logit_scale_for_contrastive_models_only() -> None:
    assert default_space(contrastive=True).names == [
        "learning_rate", "warmup_steps", "weight_decay", LOGIT_SCALE_PARAMETER
    ]  # fmt: skip
    assert LOGIT_SCALE_PARAMETER not in default_space(contrastive=False).names


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"output_dir": {"type": "categorical", "choices": ["a"]}}, "output_dir: cannot be searched"),
        ({"learning_rate": {"type": "uniform", "low": 0, "high": 1}}, "type must be one of float, int, categorical"),
        ({"learning_rate": {"type": "float", "low": 0.1}}, "a float parameter needs low and high"),
        ({"learning_rate": {"type": "float", "low": "small", "high": 1}}, "low must be a number, got 'small'"),
        ({"learning_rate": {"type": "float", "low": 0, "high": 1, "scale": 2}}, "unknown key scale"),
        ({"per_device_train_batch_size": {"type": "float", "low": 1, "high": 8}}, "the field is not a float"),
        ({"horizontal_flip": {"type": "int", "low": 0, "high": 1}}, "the field is not a number"),
        ({"gradient_accumulation_steps": {"type": "int", "low": 1, "high": 2.5}}, "needs whole low, high"),
        ({"lr_scheduler_type": {"type": "categorical", "choices": []}}, "non-empty list of choices"),
        ({"learning_rate": 0.001}, "expected a mapping such as"),
    ],
)
def test_each_mistake_names_the_parameter_and_the_fix(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^space: ") as raised:
        parse_space(values, source="space")
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_space_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "space.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a mapping of parameter names"):
        load_space(str(path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_space(str(tmp_path / "missing.yaml"))
