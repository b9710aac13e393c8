"""``--zeroshot_dataset``: every evaluation (``vlfit eval``, ``vlfit train --do_eval``) also classifies labelled
images zero-shot, with ``vlfit fewshot``'s zero-shot head, and reports top-1/top-5 under each set's name."""

from __future__ import annotations

import json
import shutil

import pytest

from vlfit.cli import main
from vlfit.data.sources.openers import labelled_splits
from vlfit.fewshot.experiment import FewShotSettings, run_fewshot
from vlfit.inference.runtime import ModelRuntime


@pytest.mark.slow
def test_eval_reports_the_zero_shot_accuracy_vlfit_fewshot_measures(labelled_checkpoint, labelled_dataset_dir,
                                                                    tmp_path) -> None:  # fmt: skip
    train, test = labelled_splits(labelled_dataset_dir, train_split="test", eval_split="test", label_column="kind")
    settings = FewShotSettings(shot_counts=[1], seeds=[0], methods=("zeroshot",))
    expected = run_fewshot(
        ModelRuntime.open(str(labelled_checkpoint)).encoder, train, test, settings, log=lambda line: None
    )
    assert main(["eval", "--model", str(labelled_checkpoint), "--dataset_name", labelled_dataset_dir,
                 "--zeroshot_dataset", labelled_dataset_dir, "--zeroshot_label_column", "kind",
                 "--output_dir", str(tmp_path / "eval"), "--report_to", "none"]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert metrics["eval_zeroshot_top1"] == pytest.approx(expected.runs[0].accuracy)
    assert metrics["eval_zeroshot_num_images"] == len(test)
    assert metrics["eval_zeroshot_top5"] == 1.0  # 4 classes: the right one is always among the best 5
    assert metrics["eval_zeroshot_chance_top1"] == pytest.approx(test.majority_share())
    assert "eval_t2i_recall@1" in metrics  # beside the retrieval metrics


@pytest.mark.slow
def test_training_logs_each_sets_accuracy_under_its_name(labelled_dataset_dir, tmp_path) -> None:
    shapes, again = tmp_path / "shapes", tmp_path / "shapes-again"
    shutil.copytree(labelled_dataset_dir, shapes)
    shutil.copytree(labelled_dataset_dir, again)
    argv = ["train", "--model_preset", "tiny", "--dataset_name", labelled_dataset_dir, "--output_dir",
            str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "8", "--report_to", "none",
            "--zeroshot_dataset", str(shapes), str(again), "--zeroshot_label_column", "kind",
            "--prompt_template", "a {} on grey", "--dataloader_num_workers", "0"]  # fmt: skip
    assert main([*argv, "--do_eval", "--eval_strategy", "steps", "--eval_steps", "1", "--save_strategy", "no"]) == 0
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    evaluations = [entry for entry in history if "eval_t2i_recall@1" in entry]
    assert len(evaluations) == 2  # at every evaluation: steps 1 and 2
    for entry in evaluations:
        assert entry["eval_zeroshot_shapes_top1"] == entry["eval_zeroshot_shapes_again_top1"]  # the same images
        assert 0 <= entry["eval_zeroshot_shapes_top1"] <= entry["eval_zeroshot_shapes_top5"] <= 1


def test_zero_shot_without_evaluation_is_refused(labelled_dataset_dir, tmp_path, capsys) -> None:
    assert main(["train", "--model_preset", "tiny", "--dataset_name", labelled_dataset_dir, "--output_dir",
                 str(tmp_path / "run"), "--zeroshot_dataset", labelled_dataset_dir]) == 2  # fmt: skip
    assert "--zeroshot_dataset is scored at every evaluation: add --do_eval" in capsys.readouterr().err


def test_zero_shot_data_errors_name_the_zero_shot_flags(labelled_dataset_dir) -> None:
    from vlfit.data.sources.openers import open_zeroshot_sets
    from vlfit.errors import DataError

    with pytest.raises(DataError, match=r"label column 'nope' not found.*Name the label column with "
                                        r"--zeroshot_label_column"):  # fmt: skip
        open_zeroshot_sets([labelled_dataset_dir], label_column="nope", split="test")
    with pytest.raises(DataError, match=r"has no split 'tset'; its splits: .*Pick one with --zeroshot_split"):
        open_zeroshot_sets([labelled_dataset_dir], label_column="kind", split="tset")
