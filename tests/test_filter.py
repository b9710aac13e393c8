"""vlfit filter: each pair scored as vlfit.load scores it, exactly the lowest dropped, the rest written with their
score as parquet that reads back, a histogram, bad images counted, mistakes refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

import vlfit
from vlfit.commands.filter import FilterArguments, filter_splits
from vlfit.data.bad_samples import BAD_SAMPLES_REPORT, BadSampleError
from vlfit.data.filtering import HISTOGRAM_NAME, Cut
from vlfit.data.sources import open_splits
from vlfit.errors import ConfigError
from vlfit.inference.runtime import ModelRuntime
from vlfit.output_folders import FILTER_REPORT

BROKEN = "train-broken"
SWAPPED = 6  # rows of train whose captions are swapped in pairs


@pytest.fixture(scope="module")
def noisy_dir(synthetic_dataset_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The synthetic data as parquet (train and validation, with a label column), with the captions of train's first
    rows swapped in pairs and one more train row whose image is not an image."""
    folder = tmp_path_factory.mktemp("noisy")
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "image_description": datasets.Value("string"),
            "instance_id": datasets.Value("string"),
            "label": datasets.Value("string"),
        }
    )
    for split, source in open_splits(dataset_name=synthetic_dataset_dir).items():
        if split == "test":
            continue
        records = list(source)[:24]
        captions = [r.caption for r in records]
        if split == "train":
            for i in range(0, SWAPPED, 2):
                captions[i], captions[i + 1] = captions[i + 1], captions[i]
        rows = {"image": [{"bytes": r.image, "path": None} for r in records], "image_description": captions,
                "instance_id": [r.id for r in records], "label": [f"label of {r.id}" for r in records]}  # fmt: skip
        if split == "train":
            rows["image"].append({"bytes": b"not an image at all", "path": None})
            rows["image_description"].append("a caption of nothing")
            rows["instance_id"].append(BROKEN)
            rows["label"].append("none")
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    return str(folder)


@pytest.fixture(scope="module")
def reference_scores(noisy_dir: str, tiny_checkpoint: Path) -> dict[str, dict[str, float]]:
    """Each good pair's cosine as ``vlfit.load`` gives it, by split and id."""
    model = vlfit.load(tiny_checkpoint)
    scores = {}
    for split, source in open_splits(dataset_name=noisy_dir).items():
        records = [r for r in source if r.id != BROKEN]
        images = model.encode_images([r.image for r in records])
        texts = model.encode_texts([r.caption for r in records])
        scores[split] = dict(zip([r.id for r in records], (images * texts).sum(axis=1).tolist(), strict=True))
    return scores


@pytest.fixture(scope="module")
def filtered(noisy_dir: str, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("filtered") / "out"
    runtime = ModelRuntime.open(tiny_checkpoint)
    filter_splits(runtime, open_splits(dataset_name=noisy_dir), str(out), Cut(drop_fraction=0.3), batch_size=7)
    return out


def test_columns_the_source_was_opened_without_are_left_out(filtered):
    assert "label" not in open_splits(dataset_name=str(filtered))["train"].column_names


def _written(folder: Path) -> dict[str, dict[str, float]]:
    splits = open_splits(dataset_name=str(folder), extra_columns=("clip_score",))
    return {split: {r.id: r.extra["clip_score"] for r in source} for split, source in splits.items()}


def test_the_lowest_fraction_is_dropped_and_the_rest_written_with_their_scores(filtered, reference_scores):
    written = _written(filtered)
    assert set(written) == {"train", "validation"}
    for split, reference in reference_scores.items():
        ranked = sorted(reference, key=reference.get)
        dropped = round(len(reference) * 0.3)
        assert set(written[split]) == set(ranked[dropped:]), split  # exactly the lowest-scoring ones are gone
        for sample_id, score in written[split].items():
            assert score == pytest.approx(reference[sample_id], abs=1e-5)
    report = json.loads((filtered / FILTER_REPORT).read_text())
    assert report["cut"] == {"drop_fraction": 0.3}
    assert report["model"]["path"].endswith("model")
    train = report["splits"]["train"]
    assert (train["read"], train["scored"], train["kept"], train["dropped"]) == (25, 24, 24 - 7, 7)
    assert train["lowest_kept_score"] == pytest.approx(min(written["train"].values()), abs=1e-6)


def test_a_bad_image_is_left_out_counted_and_listed(filtered):
    report = json.loads((filtered / FILTER_REPORT).read_text())
    assert report["splits"]["train"]["bad_samples"] == 1 and report["bad_samples"] == 1
    lines = [json.loads(line) for line in (filtered / BAD_SAMPLES_REPORT).read_text().splitlines()]
    assert [(line["split"], line["id"]) for line in lines] == [("train", BROKEN)]


def test_the_histogram_is_a_png(filtered):
    with Image.open(filtered / HISTOGRAM_NAME) as image:
        assert image.format == "PNG" and image.width > 200 and image.height > 100


def test_a_threshold_keeps_the_pairs_at_or_above_it(noisy_dir, tiny_checkpoint, reference_scores, tmp_path):
    reference = reference_scores["validation"]
    threshold = float(np.median(list(reference.values())))  # between two scores: 12 of the 24 are above it
    runtime = ModelRuntime.open(tiny_checkpoint)
    sources = open_splits(dataset_name=noisy_dir)
    filter_splits(runtime, {"validation": sources["validation"]}, str(tmp_path / "out"), Cut(min_score=threshold))
    assert set(_written(tmp_path / "out")["validation"]) == {i for i, s in reference.items() if s > threshold}


def test_an_export_scores_as_vlfit_load_runs_it(noisy_dir, onnx_export, tmp_path):
    validation = open_splits(dataset_name=noisy_dir)["validation"]
    model = vlfit.load(onnx_export)
    records = list(validation)
    reference = model.encode_images([r.image for r in records]) * model.encode_texts([r.caption for r in records])
    filter_splits(ModelRuntime.open(onnx_export), {"validation": validation}, str(tmp_path / "out"), Cut(0.5))
    written = _written(tmp_path / "out")["validation"]
    expected = dict(zip([r.id for r in records], reference.sum(axis=1).tolist(), strict=True))
    assert len(written) == len(records) // 2
    assert all(score == pytest.approx(expected[i], abs=1e-5) for i, score in written.items())
    assert json.loads((tmp_path / "out" / FILTER_REPORT).read_text())["model"]["runtime"].endswith("(int8)")


def test_raise_stops_at_the_bad_image_and_writes_nothing(noisy_dir, tiny_checkpoint, tmp_path):
    runtime = ModelRuntime.open(tiny_checkpoint)
    train = open_splits(dataset_name=noisy_dir)["train"]
    with pytest.raises(BadSampleError, match=BROKEN):
        filter_splits(runtime, {"train": train}, str(tmp_path / "out"), Cut(0.3), bad_sample_policy="raise")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        ({}, "give exactly one of --drop_fraction (e.g. 0.3) and --min_score (e.g. 0.25)"),
        ({"drop_fraction": 0.3, "min_score": 0.2}, "give exactly one of --drop_fraction"),
        ({"drop_fraction": 0.0}, "--drop_fraction must be between 0 and 1 (exclusive), not 0.0"),
        ({"drop_fraction": 1.0}, "--drop_fraction must be between 0 and 1 (exclusive), not 1.0"),
    ],
)
def test_the_cut_is_refused_in_one_line(cut, message):
    with pytest.raises(ConfigError) as refusal:
        FilterArguments(model="run", output_dir="out", **cut)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


def test_a_folder_of_something_else_is_refused_before_the_imports(tmp_path, capsys):
    from vlfit import flag_index

    (tmp_path / "notes.csv").write_text("mine")
    argv = ["--model", "run", "--output_dir", str(tmp_path), "--drop_fraction", "0.3"]
    assert flag_index.answer_early("filter", argv) == 2
    assert (
        f"--output_dir {tmp_path} is not empty (notes.csv) and vlfit filter did not write it" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_the_command_writes_a_folder_train_reads(noisy_dir, tiny_checkpoint, tmp_path, capsys):
    from vlfit.cli import main

    out = tmp_path / "out"
    argv = ["filter", "--model", str(tiny_checkpoint), "--dataset_name", noisy_dir, "--split", "train",
            "--min_score", "-1", "--output_dir", str(out), "--dataloader_num_workers", "1"]  # fmt: skip
    assert main(argv) == 0
    assert "train: kept 24 of 24 scored pairs" in capsys.readouterr().out
    written = open_splits(dataset_name=str(out), extra_columns=("label", "clip_score"))
    assert set(written) == {"train"}
    assert all(r.extra["label"] == f"label of {r.id}" for r in written["train"])  # the evaluation columns kept
    assert main(argv) == 0  # an earlier filter's folder is replaced
