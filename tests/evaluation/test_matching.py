"""Matching accuracy on data whose caption choices come without a label (what vlfit prepare keeps of them unless
told to keep the label too): the right choice is the one equal to the caption, as training's hard negatives take it."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_choices_without_a_label_are_matched_as_with_it(tiny_checkpoint, synthetic_dataset_dir, tmp_path):
    import datasets

    from vlfit.cli import main

    unlabelled = tmp_path / "unlabelled"
    datasets.load_from_disk(synthetic_dataset_dir).remove_columns("label").save_to_disk(str(unlabelled))
    figures = []
    for data in (synthetic_dataset_dir, str(unlabelled)):
        out = tmp_path / f"eval-{len(figures)}"
        assert main(["eval", "--model_name_or_path", str(tiny_checkpoint), "--dataset_name", data, "--eval_split",
                     "validation", "--output_dir", str(out), "--report_to", "none"]) == 0  # fmt: skip
        figures.append(json.loads((out / "eval_results.json").read_text()))
    labelled, without = figures
    assert "eval_matching_accuracy" in labelled
    assert without["eval_matching_accuracy"] == labelled["eval_matching_accuracy"]
