"""The table of flag rules (``vlfit.arguments.flag_rules``): each rule refuses in one line naming its flag, the same
through the command line, a flags file and the Python API, before any data opens."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

import vlfit
from vlfit.arguments import DataArguments, ModelArguments
from vlfit.arguments.flag_rules import FLAG_RULES, check_flag_rules
from vlfit.cli import main
from vlfit.errors import ConfigError
from vlfit.training.arguments import VlfitTrainingArguments


def test_every_rule_says_one_line_that_starts_with_its_flag() -> None:
    values = {name: "x" for rule in FLAG_RULES for name in rule.flags}
    for rule in FLAG_RULES:
        line = rule.message.format_map({**values, "flag": rule.flags[0]})
        assert line.startswith(f"--{rule.flags[0]}") and "\n" not in line, rule.flags


def test_wise_ft_alpha_from_a_random_preset_is_refused_through_every_door(tmp_path, capsys) -> None:
    # Nothing to interpolate towards: refused before the data (a folder that does not exist) is opened.
    flags = {"model_preset": "tiny", "dataset_name": str(tmp_path / "nowhere"), "wise_ft_alpha": 0.5,
             "output_dir": str(tmp_path / "run"), "report_to": "none"}  # fmt: skip
    refusal = "--wise_ft_alpha mixes the trained weights with the starting ones, and --model_preset tiny starts from"
    argv = [part for name, value in flags.items() for part in (f"--{name}", str(value))]
    assert main(["train", *argv]) == 2
    command_line = capsys.readouterr().err.strip().splitlines()
    assert len(command_line) == 1 and refusal in command_line[0]
    flags_file = tmp_path / "flags.json"
    flags_file.write_text(json.dumps(flags))
    assert main(["train", str(flags_file)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == command_line
    with pytest.raises(ConfigError, match="wise_ft_alpha.*model_preset") as error:
        vlfit.train(**flags)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_rule_between_training_flags_is_checked_with_the_others(tmp_path) -> None:
    training = VlfitTrainingArguments(output_dir=str(tmp_path), objective="itm", gradient_cache_chunk_size=2,
                                      report_to="none")  # fmt: skip
    model, data = ModelArguments(model_preset="tiny"), DataArguments(dataset_name=str(tmp_path))
    with pytest.raises(ConfigError, match="^--objective itm with --gradient_cache_chunk_size is not supported"):
        check_flag_rules(model, data, training, task="retrieval")


@dataclass
class ShardedRun:
    """The flags of a training run under --fsdp (VlfitTrainingArguments refuses --fsdp in one CPU process)."""

    fsdp: str = "full_shard auto_wrap"
    do_train: bool = True


def test_re_ranking_in_a_sharded_run_s_evaluation_is_refused(tmp_path) -> None:
    data = DataArguments(dataset_name=str(tmp_path), rerank_top_k=3)
    with pytest.raises(ConfigError, match="^--rerank_top_k with --fsdp .*: .* vlfit eval --rerank_top_k 3$"):
        check_flag_rules(ModelArguments(model_preset="tiny"), data, ShardedRun(), task="retrieval")


def test_vqa_on_a_dual_encoder_is_refused_naming_the_task_and_the_model(tmp_path) -> None:
    training = VlfitTrainingArguments(output_dir=str(tmp_path / "run"), report_to="none")
    data = DataArguments(dataset_name=str(tmp_path / "nowhere"))  # refused before the data would be opened
    with pytest.raises(ConfigError, match="^--task vqa fine-tunes BridgeTower .*; --model_preset clip-tiny is a dual"):
        check_flag_rules(ModelArguments(model_preset="clip-tiny"), data, training, task="vqa")
    (tmp_path / "siglip").mkdir()
    (tmp_path / "siglip" / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    with pytest.raises(ConfigError, match=r"^--task vqa .*--model_name_or_path .*siglip is a dual encoder \(CLIP or"):
        check_flag_rules(ModelArguments(model_name_or_path=str(tmp_path / "siglip")), data, training, task="vqa")
    check_flag_rules(ModelArguments(model_preset="tiny"), data, training, task="vqa")  # BridgeTower answers


def test_bf16_weights_without_bf16_or_with_lomo_is_refused(tmp_path) -> None:
    model, data = ModelArguments(model_preset="tiny"), DataArguments(dataset_name=str(tmp_path))
    fp32 = VlfitTrainingArguments(output_dir=str(tmp_path), bf16_weights=True, report_to="none")
    with pytest.raises(ConfigError, match="^--bf16_weights keeps the weights of a --bf16 run in bf16 .*: add --bf16"):
        check_flag_rules(model, data, fp32, task="retrieval")
    lomo = VlfitTrainingArguments(output_dir=str(tmp_path), bf16=True, bf16_weights=True, optim="lomo",
                                  report_to="none")  # fmt: skip
    with pytest.raises(ConfigError, match="^--bf16_weights with --optim lomo or adalomo: .*no fp32 copy"):
        check_flag_rules(model, data, lomo, task="retrieval")
    check_flag_rules(model, data, VlfitTrainingArguments(output_dir=str(tmp_path), bf16=True, bf16_weights=True,
                                                         report_to="none"), task="retrieval")  # fmt: skip
