"""Several captions per image: a list-of-captions column is one record per caption, rows that show one image share
``Record.image_key`` (by ``--image_id_column``, else by identical bytes), and ``vlfit eval`` scores unique images."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest

from tests.data.test_sources import COLOURS, _jpeg, _write_tar
from vlfit.cli import main
from vlfit.data.sources import ArrowSource, open_splits

IMAGE_FEATURES = {"image": datasets.Image(), "id": datasets.Value("string")}


def _caption_lists(captions: list[list[str] | None]) -> datasets.Dataset:
    images = [{"bytes": _jpeg(COLOURS[i % len(COLOURS)]), "path": None} for i in range(len(captions))]
    features = datasets.Features({**IMAGE_FEATURES, "captions": datasets.List(datasets.Value("string"))})
    return datasets.Dataset.from_dict(
        {"image": images, "id": [f"im{i}" for i in range(len(captions))], "captions": captions}, features=features
    )


def test_a_list_column_is_one_record_per_caption_and_empty_lists_are_counted(caplog) -> None:
    dataset = _caption_lists([["red one", "red two"], [], None, ["yellow"]])
    with caplog.at_level(logging.WARNING):
        source = ArrowSource(dataset, name="split 'x'", image_column="image", caption_column="captions")
    assert "split 'x': 2 of 4 rows have no caption in list column 'captions'" in caplog.text
    records = list(source)
    assert [r.id for r in records] == ["im0#0", "im0#1", "im3#0"]
    assert [r.caption for r in records] == ["red one", "red two", "yellow"] == source.captions()
    assert records[0].image == records[1].image == _jpeg(COLOURS[0])
    assert records[0].image_key == records[1].image_key != records[2].image_key
    assert source.select([2, 0]).captions() == ["yellow", "red one"]


def test_a_list_column_of_labels_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="label column 'captions' holds List.*expected one value per row"):
        ArrowSource(_caption_lists([["a"]]), name="n", image_column="image", caption_column="captions",
                    caption_role="label")  # fmt: skip


def test_the_image_id_column_groups_rows_whatever_their_bytes(tmp_path: Path) -> None:
    rows = {"image": [{"bytes": _jpeg(c), "path": None} for c in COLOURS[:3]], "id": ["a", "b", "c"],
            "caption": ["x", "y", "z"], "coco_id": [7, 7, 9]}  # fmt: skip
    dataset = datasets.Dataset.from_dict(rows, features=datasets.Features(
        {**IMAGE_FEATURES, "caption": datasets.Value("string"), "coco_id": datasets.Value("int64")}))  # fmt: skip
    dataset.save_to_disk(str(tmp_path / "arrow"))
    grouped = open_splits(dataset_name=str(tmp_path / "arrow"), caption_column="caption", image_id_column="coco_id")
    keys = [record.image_key for record in grouped["train"]]
    assert keys[0] == keys[1] != keys[2]
    by_bytes = open_splits(dataset_name=str(tmp_path / "arrow"), caption_column="caption")["train"]
    assert len({record.image_key for record in by_bytes}) == 3
    with pytest.raises(ValueError, match="image_id column 'image_nr' not found"):
        open_splits(dataset_name=str(tmp_path / "arrow"), caption_column="caption", image_id_column="image_nr")

    # WebDataset shards: the image id is a key of each sample's json (or a member of its own), like extra columns.
    members = []
    for i, image_id in enumerate(["p", "p", "q"]):
        meta = {"caption": f"caption {i}", "image_id": image_id}
        members += [(f"s{i}.jpg", _jpeg(COLOURS[i])), (f"s{i}.json", json.dumps(meta).encode())]
    _write_tar(tmp_path / "train-000.tar", members)
    shards = open_splits(train_file=str(tmp_path / "train-000.tar"), caption_column="caption",
                         image_id_column="image_id")["train"]  # fmt: skip
    records = list(shards)
    assert records[0].image_key == records[1].image_key != records[2].image_key
    assert all(record.extra == {} for record in records)  # read for grouping, not passed on as a column


def test_eval_scores_unique_images_and_all_their_captions(tmp_path: Path) -> None:
    validation = _caption_lists([["a red square", "red", "a square of red"], ["green"], ["blue", "a blue one"]])
    datasets.DatasetDict({"train": validation, "validation": validation}).save_to_disk(str(tmp_path / "data"))
    assert main(["eval", "--model_preset", "tiny", "--dataset_name", str(tmp_path / "data"), "--caption_column",
                 "captions", "--output_dir", str(tmp_path / "eval"), "--report_to", "none"]) == 0  # fmt: skip
    metrics = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert metrics["eval_num_images"] == 3 and metrics["eval_num_texts"] == 6
    assert metrics["eval_chance_recall@1"] == pytest.approx(1 / 3)
