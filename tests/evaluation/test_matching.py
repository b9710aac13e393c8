"""Matching accuracy takes the choices and the right one as training's hard negatives do: on data whose caption
choices come without a label (what vlfit prepare keeps of them unless told to keep the label too) the right choice is
the one equal to the caption, and data whose alternatives are in another column is matched on the column
``--hard_negative_column`` names."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_choices_without_a_label_or_in_another_column_are_matched_as_the_original(
    tiny_checkpoint, synthetic_dataset_dir, tmp_path
):
    import datasets

    from vlfit.cli import main

    original = datasets.load_from_disk(synthetic_dataset_dir)
    unlabelled, renamed = tmp_path / "unlabelled", tmp_path / "renamed"
    original.remove_columns("label").save_to_disk(str(unlabelled))
    original.rename_column("caption_choices", "alternatives").save_to_disk(str(renamed))

    def evaluate(data: str, *flags: str) -> dict:
        out = tmp_path / f"eval-{len(list(tmp_path.glob('eval-*')))}"
        assert main(["eval", "--model_name_or_path", str(tiny_checkpoint), "--dataset_name", data, "--eval_split",
                     "validation", "--output_dir", str(out), "--report_to", "none", *flags]) == 0  # fmt: skip
        return json.loads((out / "eval_results.json").read_text())

    expected = evaluate(synthetic_dataset_dir)["eval_matching_accuracy"]
    assert evaluate(str(unlabelled))["eval_matching_accuracy"] == expected
    assert evaluate(str(renamed), "--hard_negative_column", "alternatives")["eval_matching_accuracy"] == expected
    assert "eval_matching_accuracy" not in evaluate(str(renamed))  # no choices named: skipped, as before
