"""Few-shot and zero-shot count images as retrieval evaluation does: rows that show one image (identical bytes, or
one ``--image_id_column`` value) are one image, drawn and classified once; both say how many rows they read."""

from __future__ import annotations

import json

import datasets
import pytest

from vlfit.cli import main
from vlfit.commands.fewshot import data_read
from vlfit.data.sources.openers import labelled_splits, open_zeroshot_sets
from vlfit.errors import DataError

ROWS_PER_IMAGE = 3


@pytest.fixture(scope="module")
def tripled_dataset_dir(labelled_dataset_dir, tmp_path_factory) -> str:
    """The labelled set with each row three times: one image, three captions (and a per-row ``photo`` id)."""
    original = datasets.load_from_disk(labelled_dataset_dir)

    def tripled(split: datasets.Dataset) -> datasets.Dataset:
        rows = [i for i in range(len(split)) for _ in range(ROWS_PER_IMAGE)]
        out = split.select(rows)
        captions = [f"{caption} (caption {n % ROWS_PER_IMAGE})" for n, caption in enumerate(out["image_description"])]
        out = out.remove_columns("image_description").add_column("image_description", captions)
        return out.add_column("photo", [f"p{n}" for n in range(len(out))])

    path = tmp_path_factory.mktemp("tripled") / "data"
    datasets.DatasetDict({name: tripled(split) for name, split in original.items()}).save_to_disk(str(path))
    return str(path)


def test_rows_of_one_image_are_one_labelled_image(labelled_dataset_dir, tripled_dataset_dir) -> None:
    once, _ = labelled_splits(labelled_dataset_dir, train_split="test", eval_split="test", label_column="kind")
    train, evaluation = labelled_splits(tripled_dataset_dir, train_split="train", eval_split="test",
                                        label_column="kind")  # fmt: skip
    assert len(evaluation) == len(once) and evaluation.num_rows == ROWS_PER_IMAGE * len(once)
    assert list(evaluation.labels) == list(once.labels)
    assert data_read(train, evaluation, "train", "test") == (
        f"shots from {len(train)} images ({train.num_rows} rows) of 'train', accuracy on {len(once)} images "
        f"({ROWS_PER_IMAGE * len(once)} rows) of 'test'"
    )


def test_the_image_id_column_says_which_rows_are_one_image(tripled_dataset_dir) -> None:
    _, evaluation = labelled_splits(tripled_dataset_dir, train_split="train", eval_split="test", label_column="kind",
                                    image_id_column="photo")  # fmt: skip
    assert len(evaluation) == evaluation.num_rows  # every row its own photo, though the bytes repeat


def test_rows_of_one_image_with_two_classes_are_refused(tripled_dataset_dir) -> None:
    split = datasets.load_from_disk(tripled_dataset_dir)["test"]
    kinds = list(split["kind"])
    kinds[1] = next(kind for kind in set(kinds) if kind != kinds[0])  # row 1 shows row 0's image
    path = tripled_dataset_dir + "-contradicting"
    datasets.DatasetDict({"test": split.remove_columns("kind").add_column("kind", kinds)}).save_to_disk(path)
    with pytest.raises(DataError, match=r"rows 0 and 1 show one image but are labelled .* and .* in 'kind'"):
        labelled_splits(path, train_split="test", eval_split="test", label_column="kind")


def test_a_zero_shot_set_holds_each_image_once(tripled_dataset_dir) -> None:
    (zeroshot,) = open_zeroshot_sets([tripled_dataset_dir], label_column="kind", split="test")
    assert zeroshot.split.num_rows == ROWS_PER_IMAGE * len(zeroshot.split)


@pytest.mark.slow
def test_zero_shot_counts_the_images_retrieval_counts(labelled_checkpoint, tripled_dataset_dir, tmp_path) -> None:
    assert main(["eval", "--model", str(labelled_checkpoint), "--dataset_name", tripled_dataset_dir, "--eval_split",
                 "test", "--zeroshot_dataset", tripled_dataset_dir, "--zeroshot_label_column", "kind",
                 "--output_dir", str(tmp_path), "--report_to", "none"]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "eval_results.json").read_text())
    assert metrics["eval_zeroshot_num_images"] == metrics["eval_num_images"]
    assert metrics["eval_zeroshot_num_rows"] == metrics["eval_num_texts"] == ROWS_PER_IMAGE * metrics["eval_num_images"]
