"""``vlfit fewshot`` and ``vlfit classify`` end to end on the tiny preset and a labelled synthetic set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.bench_runs import assert_png
from vlfit.cli import main

pytestmark = pytest.mark.slow

METHODS = ("zeroshot", "linear_probe", "setfit")


def _fewshot(model: Path, data: str, out: Path, *extra: str) -> dict:
    assert main(["fewshot", "--model_name_or_path", str(model), "--dataset_name", data, "--label_column", "kind",
                 "--output_dir", str(out), "--shots", "1,2", "--seeds", "2", "--setfit_steps", "3",
                 *extra]) == 0  # fmt: skip
    return json.loads((out / "fewshot.json").read_text())


@pytest.fixture(scope="module")
def fewshot_run(labelled_checkpoint, labelled_dataset_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fewshot")
    document = _fewshot(labelled_checkpoint, labelled_dataset_dir, out / "report", "--save_classifier",
                        str(out / "classifier"))  # fmt: skip
    return out, document


def test_every_method_runs_for_two_shot_counts_and_two_seeds(fewshot_run) -> None:
    out, document = fewshot_run
    runs = document["runs"]
    for method in ("linear_probe", "setfit"):
        assert sorted((r["shots"], r["seed"]) for r in runs if r["method"] == method) == [
            (1, 0),
            (1, 1),
            (2, 0),
            (2, 1),
        ]
    assert [(r["shots"], r["seed"]) for r in runs if r["method"] == "zeroshot"] == [(0, 0)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in runs)
    assert document["classes"] == ["circle", "square", "triangle", "cross"]
    assert document["eval_images"] == 18
    for method in ("linear_probe", "setfit"):
        for shots in ("1", "2"):
            accuracies = [r["accuracy"] for r in runs if r["method"] == method and str(r["shots"]) == shots]
            row = document["summary"][method][shots]
            assert row["runs"] == 2 and row["mean"] == pytest.approx(sum(accuracies) / 2)
    # One-shot heads cannot be cross-validated: the fallbacks; SetFit's pulls toward the zero-shot head.
    assert {r["head"] for r in runs if r["shots"] == 1 and r["method"] == "setfit"} == {"anchored strength=0.01"}
    table = (out / "report" / "fewshot.md").read_text()
    assert "| zero-shot |" in table and "| linear probe |" in table and "| SetFit |" in table
    assert_png(out / "report" / "fewshot.png")


def test_the_same_seed_gives_the_same_table(fewshot_run, labelled_checkpoint, labelled_dataset_dir, tmp_path) -> None:
    _, document = fewshot_run
    # One of the four draws again (the last --shots and --seeds win): the same shots, heads and accuracies.
    again = _fewshot(labelled_checkpoint, labelled_dataset_dir, tmp_path / "again", "--shots", "1", "--seeds", "1")

    def key(run: dict) -> tuple:
        return run["method"], str(run["shots"]), run["seed"]

    before = {key(r): (r["head"], r["accuracy"]) for r in document["runs"]}
    assert {key(r) for r in again["runs"]} == {("zeroshot", "0", 0), ("linear_probe", "1", 0), ("setfit", "1", 0)}
    assert {key(r): (r["head"], r["accuracy"]) for r in again["runs"]} == {
        key(r): before[key(r)] for r in again["runs"]
    }
    other = _fewshot(labelled_checkpoint, labelled_dataset_dir, tmp_path / "other", "--seed", "7",
                     "--methods", "linear_probe", "--shots", "1")  # fmt: skip
    assert [r["seed"] for r in other["runs"]] == [7, 8]


def test_the_saved_classifier_reloads_and_predicts_what_it_measured(fewshot_run, labelled_dataset_dir, capsys) -> None:
    out, document = fewshot_run
    folder = out / "classifier"
    info = json.loads((folder / "classifier.json").read_text())
    best = max(
        document["summary"], key=lambda m: document["summary"][m].get("2", document["summary"][m].get("0"))["mean"]
    )
    assert info["method"] == best and info["class_names"] == document["classes"]
    capsys.readouterr()
    preds = out / "preds.jsonl"
    assert main(["classify", "--model", str(folder), "--dataset_name", labelled_dataset_dir, "--split", "test",
                 "--label_column", "kind", "--output", str(preds), "--dataloader_num_workers", "0"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    lines = [json.loads(line) for line in preds.read_text().splitlines()]
    assert len(lines) == 18
    assert all(line["label"] in info["class_names"] for line in lines)
    assert all(abs(sum(line["probabilities"].values()) - 1) < 1e-4 for line in lines)
    # The reloaded model and head give the accuracy the run measured with them in memory.
    correct = round(info["accuracy"] * 18)
    assert f"accuracy against 'kind': {correct / 18:.4f} ({correct}/18)" in printed


def test_classify_takes_files_and_folders_and_lists_the_bad_images(fewshot_run, labelled_dataset_dir, tmp_path,
                                                                     capsys) -> None:  # fmt: skip
    from vlfit.data.sources import open_splits

    out, _ = fewshot_run
    records = list(open_splits(dataset_name=labelled_dataset_dir, caption_column=None)["test"])[:5]
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for i, record in enumerate(records[:4]):
        (folder / "sub" / f"{i}.jpg").write_bytes(record.image)
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    single = tmp_path / "single.jpg"
    single.write_bytes(records[4].image)
    capsys.readouterr()
    assert main(["classify", "--model", str(out / "classifier"), str(folder), str(single),
                 "--dataloader_num_workers", "0"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    ids = [line.split("\t")[0] for line in captured.out.strip().splitlines()]
    assert ids == [*(str(folder / "sub" / f"{i}.jpg") for i in range(4)), str(single)]
    assert "skipped 1 images" in captured.err and "broken.jpg" in captured.err


@pytest.fixture(scope="module")
def one_class_dataset_dir(labelled_dataset_dir, tmp_path_factory) -> str:
    """The labelled set with a column ``one_class`` that holds one class."""
    import datasets

    loaded = datasets.load_from_disk(labelled_dataset_dir)
    path = str(tmp_path_factory.mktemp("one-class") / "data")
    datasets.DatasetDict({name: split.add_column("one_class", ["thing"] * len(split))
                          for name, split in loaded.items()}).save_to_disk(path)  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--label_column", "nope"], "label column 'nope' not found"),
        (["--label_column", "one_class"], "label column 'one_class' of split 'train' holds 1 class ('thing')"),
        (["--label_column", "kind", "--shots", "1,40"], "--shots 40: class"),
        (["--label_column", "kind", "--methods", "zeroshot,magic"], "--methods: unknown ['magic']"),
        (["--label_column", "kind", "--prompt_template", "a photo"], "must hold '{}' once"),
    ],
)
def test_bad_input_stops_with_one_line(extra, message, labelled_checkpoint, one_class_dataset_dir, tmp_path,
                                       capsys) -> None:  # fmt: skip
    capsys.readouterr()
    code = main(["fewshot", "--model_name_or_path", str(labelled_checkpoint), "--dataset_name", one_class_dataset_dir,
                 "--output_dir", str(tmp_path / "out"), *extra])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfit fewshot: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_the_splits_can_be_data_files_as_train_and_eval_take_them(labelled_checkpoint, labelled_dataset_dir,
                                                                   tmp_path) -> None:  # fmt: skip
    import datasets

    loaded = datasets.load_from_disk(labelled_dataset_dir)
    files = {split: str(tmp_path / f"{split}.parquet") for split in ("train", "test")}
    for split, path in files.items():
        loaded[split].to_parquet(path)
    out = tmp_path / "out"
    assert main(["fewshot", "--model_name_or_path", str(labelled_checkpoint), "--train_file", files["train"],
                 "--test_file", files["test"], "--label_column", "kind", "--output_dir", str(out), "--shots", "1",
                 "--seeds", "1", "--methods", "zeroshot"]) == 0  # fmt: skip
    document = json.loads((out / "fewshot.json").read_text())
    assert document["dataset"] == f"{files['train']}, {files['test']}"
    assert document["eval_images"] == len(loaded["test"])
