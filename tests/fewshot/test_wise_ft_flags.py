"""``vlfit wise-ft`` refuses its flags' mistakes before any model loads, each in one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlfit.commands import wise_ft
from vlfit.errors import ConfigError, MissingFileError


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--zeroshot_model", str(tmp_path / "no-such-a"), "--finetuned_model", str(tmp_path / "no-such-b"),
            "--dataset_name", str(tmp_path), "--output_dir", str(tmp_path / "out"), *extra]  # fmt: skip


def test_a_missing_zeroshot_dataset_is_named_as_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--zeroshot_dataset is required: the labelled data"):
        wise_ft.main(_argv(tmp_path))


def test_help_says_the_zeroshot_dataset_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        wise_ft.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--zeroshot_dataset, which is required" in text and "Required by vlfit wise-ft." in text


def test_a_preset_name_is_refused_as_a_preset_not_looked_up_on_the_hub(tmp_path: Path) -> None:
    argv = _argv(tmp_path, "--zeroshot_dataset", str(tmp_path))
    argv[1] = "clip-tiny"
    with pytest.raises(ConfigError, match=r"^--zeroshot_model clip-tiny: a preset's name, not a trained model") as e:
        wise_ft.main(argv)
    assert "--model_preset" not in str(e.value) and "huggingface" not in str(e.value)


@pytest.mark.parametrize("metric", ["alpha", "eval_num_images", "eval_t2i_recall@3"])
def test_a_target_metric_that_is_no_score_is_refused_before_the_models_are_looked_at(tmp_path: Path, metric: str):
    with pytest.raises(ConfigError, match=rf"^--target_metric '{metric}' is not a metric of the target split"):
        wise_ft.main(_argv(tmp_path, "--zeroshot_dataset", str(tmp_path), "--target_metric", metric))


@pytest.mark.parametrize("metric", ["eval_t2i_rerank_recall@5", "eval_i2t_fused_recall@1"])
def test_re_ranked_and_fused_recalls_are_target_metrics(tmp_path: Path, metric: str):
    with pytest.raises(MissingFileError, match="^--zeroshot_model "):  # past the metric: the models are looked at
        wise_ft.main(_argv(tmp_path, "--zeroshot_dataset", str(tmp_path), "--target_metric", metric))
