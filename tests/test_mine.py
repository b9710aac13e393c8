"""vlfit mine: each caption's negatives are the captions of other images its image scores highest against (as
vlfit.load scores them), never its own image's, none above the positive-aware cut; the copy reads back, trains with
--hard_negative_column, and mistakes are refused in one line. With --index, the same negatives from the index's image
embeddings, no image embedded; tar shards at URLs are mined as any split."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

import vlfit
from tests.http_shards import ShardServer, webdataset_shard
from vlfit.commands.mine import MineArguments, mine_split
from vlfit.commands.mine import main as mine_main
from vlfit.commands.mine_index import check_index_model, indexed_pairs, open_mining_index
from vlfit.data.hard_negatives import alternative_captions
from vlfit.data.mining import MiningRule, mine_negatives
from vlfit.data.sources import open_splits
from vlfit.errors import ConfigError
from vlfit.index.job import IndexJob, index_collection
from vlfit.inference.runtime import ModelRuntime
from vlfit.output_folders import MINE_REPORT

K = 3
RATIO = 0.95
SECOND = "a second caption of the first image"  # a second row showing the first image (equal bytes)


@pytest.fixture(scope="module")
def shared_image_dir(synthetic_dataset_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The synthetic data's first rows as parquet, train with one more row showing its first image (the same
    bytes) with another caption."""
    folder = tmp_path_factory.mktemp("shared-image")
    for split, source in open_splits(dataset_name=synthetic_dataset_dir, extra_columns=("label",)).items():
        records = list(source)[: 20 if split == "train" else 6]
        rows = {"image": [{"bytes": r.image, "path": None} for r in records],
                "image_description": [r.caption for r in records], "instance_id": [r.id for r in records],
                "label": [r.extra["label"] for r in records]}  # fmt: skip
        if split == "train":
            rows["image"].append(rows["image"][0])
            rows["image_description"].append(SECOND)
            rows["instance_id"].append("second-caption")
            rows["label"].append("A")
        text = datasets.Value("string")
        features = datasets.Features({"image": datasets.Image(), "image_description": text, "instance_id": text,
                                      "label": text})  # fmt: skip
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    return str(folder)


@pytest.fixture(scope="module")
def mined(shared_image_dir: str, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mined") / "out"
    sources = open_splits(dataset_name=shared_image_dir, extra_columns=("label",))
    mine_split(ModelRuntime.open(tiny_checkpoint), sources, "train", str(out), MiningRule(K, RATIO), batch_size=8,
               columns={"extra_columns": ("label",)})  # fmt: skip
    return out


def _indexed(dataset_name: str, model: Path, out: Path) -> str:
    """The index vlfit retrieve index builds of the split train of ``dataset_name``."""
    index_collection(IndexJob(model=str(model), output_dir=str(out), dataset_name=dataset_name, split="train",
                              batch_size=8, progress=False))  # fmt: skip
    return str(out)


def _location(dataset_name: str, split: str = "train") -> dict[str, str | None]:
    """The split as vlfit mine's flags name it (their defaults), to match against an index's record."""
    return {"dataset_name": dataset_name, "split": split, "image_column": "image",
            "caption_column": "image_description", "image_id_column": None}  # fmt: skip


def _counting_images(runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the image batches ``runtime``'s encoder is asked to embed from now on."""
    calls: list[int] = []
    embed = runtime.encoder.encode_images

    def counted(*args, **kwargs):
        calls.append(1)
        return embed(*args, **kwargs)

    monkeypatch.setattr(runtime.encoder, "encode_images", counted)
    return calls


def _written(folder: Path, split: str = "train") -> dict[str, list[str]]:
    source = open_splits(dataset_name=str(folder), extra_columns=("mined_negatives", "label"))[split]
    return {r.id: r.extra.get("mined_negatives") for r in source}


def test_the_negatives_are_the_hardest_captions_of_other_images_below_the_cut(mined, shared_image_dir, tiny_checkpoint):
    records = list(open_splits(dataset_name=shared_image_dir)["train"])
    model = vlfit.load(tiny_checkpoint)
    images = model.encode_images([r.image for r in records])
    texts = dict(zip([r.caption for r in records], model.encode_texts([r.caption for r in records]), strict=True))
    written = _written(mined)
    assert set(written) == {r.id for r in records}
    cut_somewhere = False
    for record, image in zip(records, images, strict=True):
        own = {r.caption for r in records if r.image == record.image}
        scores = {caption: float(image @ vector) for caption, vector in texts.items() if caption not in own}
        positive = float(image @ texts[record.caption])
        limit = min(RATIO * positive, positive)  # never above the positive itself (a random model's can be < 0)
        allowed = sorted((s for s in scores.values() if s <= limit - 1e-5), reverse=True)
        cut_somewhere |= any(s > limit + 1e-5 for s in scores.values())
        negatives = written[record.id]
        assert not own & set(negatives), record.id  # never a caption of the same image
        assert len(negatives) == len(set(negatives)) == min(K, len(allowed)), record.id
        for caption in negatives:
            assert scores[caption] <= limit + 1e-5  # none above the positive-aware cut
            assert scores[caption] >= allowed[len(negatives) - 1] - 1e-5  # among the K highest below it
        assert [scores[c] for c in negatives] == sorted((scores[c] for c in negatives), reverse=True)
    assert cut_somewhere  # the cut had something to drop
    report = json.loads((mined / MINE_REPORT).read_text())
    assert report["candidates_dropped_as_positives"] > 0 and report["mined"] == len(records)


def test_the_same_image_by_its_bytes_shares_no_negatives(mined, shared_image_dir):
    records = list(open_splits(dataset_name=shared_image_dir)["train"])
    written = _written(mined)
    assert SECOND not in written[records[0].id] and records[0].caption not in written["second-caption"]


def test_an_index_of_the_split_gives_the_same_negatives_without_embedding_an_image(
    mined, shared_image_dir, tiny_checkpoint, tmp_path, monkeypatch
):
    index = open_mining_index(_indexed(shared_image_dir, tiny_checkpoint, tmp_path / "index"),
                              _location(shared_image_dir))  # fmt: skip
    runtime = ModelRuntime.open(tiny_checkpoint)
    images = _counting_images(runtime, monkeypatch)
    sources = open_splits(dataset_name=shared_image_dir, extra_columns=("label",))
    report = mine_split(runtime, sources, "train", str(tmp_path / "out"), MiningRule(K, RATIO), batch_size=8,
                        columns={"extra_columns": ("label",)}, index=index)  # fmt: skip
    assert images == []  # the captions alone were embedded
    assert _written(tmp_path / "out") == _written(mined)
    before = json.loads((mined / MINE_REPORT).read_text())
    assert report["index"] == index.path and before["index"] is None
    assert {k: v for k, v in report.items() if k != "index"} == {k: v for k, v in before.items() if k != "index"}


def test_an_index_of_other_data_or_another_model_is_refused_in_one_line(
    shared_image_dir, tiny_checkpoint, other_checkpoint, tmp_path
):
    path = _indexed(shared_image_dir, tiny_checkpoint, tmp_path / "index")
    refusals = []
    with pytest.raises(ConfigError) as refusal:
        open_mining_index(path, _location(shared_image_dir, "validation"))
    refusals.append((refusal, "--split train there, validation here"))
    with pytest.raises(ConfigError) as refusal:
        open_mining_index(path, {**_location(shared_image_dir), "image_id_column": "instance_id"})
    refusals.append((refusal, "--image_id_column None there, instance_id here"))
    index = open_mining_index(path, _location(shared_image_dir))
    with pytest.raises(ConfigError) as refusal:
        check_index_model(index, ModelRuntime.open(other_checkpoint))
    refusals.append((refusal, "weights checkpoint"))
    validation = open_splits(dataset_name=shared_image_dir)["validation"]  # rows the index does not hold
    with pytest.raises(ConfigError) as refusal:
        indexed_pairs(ModelRuntime.open(tiny_checkpoint), validation, index, validation.image_keys())
    refusals.append((refusal, "lacks 6 of the split's 6 images"))
    for refused, named in refusals:
        message = str(refused.value)
        assert message.startswith(f"--index {path} ") and named in message and "\n" not in message, message


def test_an_image_the_index_left_out_is_a_bad_sample_of_the_mining_too(
    synthetic_dataset_dir, tiny_checkpoint, tmp_path
):
    data = tmp_path / "data"
    records = list(open_splits(dataset_name=synthetic_dataset_dir)["validation"])
    images = [{"bytes": b"not a jpeg" if i == 2 else r.image, "path": None} for i, r in enumerate(records)]
    rows = {"image": images, "image_description": [r.caption for r in records], "instance_id": [r.id for r in records]}
    features = datasets.Features({"image": datasets.Image(), "image_description": datasets.Value("string"),
                                  "instance_id": datasets.Value("string")})  # fmt: skip
    data.mkdir()
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(data / "train-00000-of-00001.parquet"))
    index = open_mining_index(_indexed(str(data), tiny_checkpoint, tmp_path / "index"), _location(str(data)))
    runtime, sources = ModelRuntime.open(tiny_checkpoint), open_splits(dataset_name=str(data))
    plain = mine_split(runtime, sources, "train", str(tmp_path / "plain"), MiningRule(2, RATIO), batch_size=4)
    indexed = mine_split(runtime, sources, "train", str(tmp_path / "indexed"), MiningRule(2, RATIO), batch_size=4,
                         index=index)  # fmt: skip
    assert plain["bad_samples"] == indexed["bad_samples"] == 1 and indexed["mined"] == len(records) - 1
    assert _written(tmp_path / "indexed") == _written(tmp_path / "plain") and records[2].id not in _written(
        tmp_path / "plain"
    )
    listed = (tmp_path / "indexed" / "bad_samples.jsonl").read_text()
    assert records[2].id in listed and "the index left its image out" in listed


def test_tar_shards_at_urls_are_mined_and_with_their_index_alike(tiny_checkpoint, tmp_path, monkeypatch):
    """Shards at URLs (a '::' spec of two sources) are read from local copies, as every split read by row; the copy
    is parquet that reads back with the column; an index built of the same shards (vlfit retrieve index, a shard
    at a time) gives the same negatives with no image embedded."""
    files = {f"/{name}/000.tar": webdataset_shard(name, 6, seed=seed)[0] for seed, name in enumerate("ab")}
    with ShardServer(files) as server:
        spec = "::".join(server.url(path) for path in files)
        rule = MiningRule(2, RATIO)
        sources = open_splits(dataset_name=spec)
        mine_split(ModelRuntime.open(tiny_checkpoint), sources, "train", str(tmp_path / "plain"), rule, batch_size=4)
        index = open_mining_index(_indexed(spec, tiny_checkpoint, tmp_path / "index"), _location(spec))
    runtime = ModelRuntime.open(tiny_checkpoint)
    images = _counting_images(runtime, monkeypatch)
    mine_split(runtime, sources, "train", str(tmp_path / "indexed"), rule, batch_size=4, index=index)
    written = _written(tmp_path / "plain")
    assert images == [] and _written(tmp_path / "indexed") == written
    assert len(written) == 12 and all(len(negatives) <= 2 for negatives in written.values())
    assert sum(len(negatives) for negatives in written.values()) > 0


def test_the_other_splits_are_copied_and_the_column_is_what_training_takes(mined, shared_image_dir):
    assert len(_written(mined, "validation")) == 6
    assert all(negatives is None for negatives in _written(mined, "validation").values())
    for record in open_splits(dataset_name=str(mined), extra_columns=("mined_negatives", "label"))["train"]:
        assert "label" not in record.extra  # it points into caption_choices; training would read it as the negatives'
        negatives = record.extra["mined_negatives"]
        assert alternative_captions(negatives, record.caption, column="mined_negatives") == negatives


def test_a_candidate_above_the_ratio_is_dropped_and_the_same_image_never_offered():
    # row 0 shows image A; rows 1 and 2 show image B (equal keys); row 3 image C. Row 0's own pair scores 1.
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.6, 0.8]])
    texts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [0.6, 0.8]])
    captions = ["a", "b", "b2", "c"]
    keys = torch.tensor([10, 20, 20, 30])
    mined = mine_negatives(images, texts, captions, keys, MiningRule(2, 0.7))
    assert mined.captions[0] == ["c", "b"]  # b2 scores 0.8 > 0.7 x 1: dropped as a likely positive
    assert mined.dropped[0] == 1
    assert "b" not in mined.captions[2] and "b2" not in mined.captions[1]  # never the same image's captions
    assert mine_negatives(images, texts, captions, keys, MiningRule(2, 1.0)).captions[0] == ["b2", "c"]
    # a negative positive (-0.5): 0.5 x -0.5 is above it, so the cut is the positive itself (b2 at -0.4 is out)
    flipped = mine_negatives(images, torch.tensor([[-0.5, 0.0], [0.0, 1.0], [-0.4, 0.0], [-0.6, 0.0]]), captions,
                             keys, MiningRule(3, 0.5))  # fmt: skip
    assert flipped.captions[0] == ["c"] and flipped.dropped[0] == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"num_negatives": 0}, "--num_negatives must be at least 1, not 0"),
        ({"max_negative_ratio": 0.0}, "--max_negative_ratio must be in (0, 1]"),
        ({"max_negative_ratio": 1.5}, "--max_negative_ratio must be in (0, 1]"),
    ],
)
def test_the_rule_is_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError) as refusal:
        MineArguments(model="run", output_dir="out", **flags)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


@pytest.mark.slow
def test_under_torchrun_the_processes_embed_the_images_together_and_the_first_mines(
    mined, shared_image_dir, tiny_checkpoint, tmp_path
):
    """Two processes index the split beside the output (each its share, as vlfit retrieve index), then the first
    mines with that index: the negatives one process finds, and an index a rerun reuses."""
    from tests.training.train_runs import run_torchrun

    out = tmp_path / "mined"
    done = run_torchrun("-m", "vlfit", "mine", "--model", str(tiny_checkpoint), "--dataset_name", shared_image_dir,
                        "--output_dir", str(out), "--num_negatives", str(K), "--batch_size", "8",
                        "--dataloader_num_workers", "0")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _written(out) == _written(mined)
    report = json.loads((out / MINE_REPORT).read_text())
    assert report["index"] == f"{out}-index"
    assert open_mining_index(report["index"], _location(shared_image_dir)).manifest.count == 20  # 21 rows, 20 images


def test_under_torchrun_data_given_otherwise_than_by_dataset_name_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^under torchrun, vlfit mine embeds the split as vlfit retrieve") as no:
        mine_main(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "out"), "--train_file", "x"])
    assert "\n" not in str(no.value) and not (tmp_path / "out").exists()


def test_a_folder_of_something_else_is_refused_before_the_imports(tmp_path, capsys):
    from vlfit import flag_index

    (tmp_path / "notes.csv").write_text("mine")
    assert flag_index.answer_early("mine", ["--model", "run", "--output_dir", str(tmp_path)]) == 2
    assert (
        f"--output_dir {tmp_path} is not empty (notes.csv) and vlfit mine did not write it" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_the_command_writes_a_folder_train_takes_with_its_negatives(shared_image_dir, tiny_checkpoint, tmp_path):
    from vlfit.cli import main

    out = tmp_path / "mined"
    assert main(["mine", "--model", str(tiny_checkpoint), "--dataset_name", shared_image_dir, "--output_dir", str(out),
                 "--num_negatives", "2", "--dataloader_num_workers", "0"]) == 0  # fmt: skip
    counts = [len(negatives) for negatives in _written(out).values()]
    assert max(counts) == 2  # none past --num_negatives; fewer where the cut leaves fewer
    assert main(["train", "--model_preset", "tiny", "--dataset_name", str(out), "--output_dir", str(tmp_path / "run"),
                 "--hard_negative_column", "mined_negatives", "--max_steps", "2", "--per_device_train_batch_size", "4",
                 "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
                 "--dataloader_num_workers", "0"]) == 0  # fmt: skip
