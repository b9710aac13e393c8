"""``--train_sampling_strategy group_by_length`` for NaFlex models: each image's patch count comes from its header
as the loader cuts it, the sampler makes batches of similar counts in a new order each epoch, a real run then pads
fewer patches (``train_padded_patch_share``), and the flag is refused in one line where it cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from tests.models.test_siglip2 import PHOTOS, encoded, photo
from vlfit.arguments import DataArguments, ModelArguments
from vlfit.arguments.flag_rules import check_flag_rules
from vlfit.cli import main
from vlfit.data.naflex import NaflexTransform
from vlfit.data.patch_count_grouping import PatchCountGroupedSampler, patch_counts
from vlfit.data.records import Record
from vlfit.data.sources.memory import MemorySource
from vlfit.errors import ConfigError
from vlfit.models.loading import resolve_model
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.sampling import check_train_sampling


def padded_share(order: list[int], lengths: list[int], batch_size: int) -> float:
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    padded = sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)
    return 1 - sum(lengths) / padded


def test_patch_counts_are_the_grids_the_loader_cuts_and_an_unreadable_image_counts_as_the_budget() -> None:
    images = [make() for make in PHOTOS.values()] + [b"not an image"]
    source = MemorySource([Record(id=f"r{i}", image=data, caption="c") for i, data in enumerate(images)])
    counts = patch_counts(source, patch_size=16, max_num_patches=24)
    transform = NaflexTransform(16, 24)
    assert counts[:-1] == [transform(data).patches.shape[0] for data in images[:-1]]
    assert len(set(counts[:-1])) > 1 and max(counts[:-1]) <= 24
    assert counts[-1] == 24


def test_grouped_batches_hold_similar_counts_in_a_new_order_each_epoch() -> None:
    lengths = np.random.default_rng(0).integers(40, 257, 1000).tolist()
    sampler = PatchCountGroupedSampler(lengths, batch_size=16, seed=5)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    assert all(sorted(order) == list(range(1000)) for order in epochs)
    assert epochs[0] != epochs[1]
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    assert padded_share(epochs[0], lengths, 16) < padded_share(shuffled, lengths, 16) / 5
    assert max(lengths[i] for i in epochs[0][:16]) == max(lengths)  # the longest batch first: memory fails at once
    resumed = PatchCountGroupedSampler(lengths, batch_size=16, seed=5)
    resumed.set_epoch(1)
    assert list(resumed) == epochs[1]  # a resumed run reads what the uninterrupted one read


@pytest.mark.slow
def test_a_naflex_run_grouped_by_length_pads_fewer_patches(tmp_path: Path) -> None:
    # 96 images in batches of 4: transformers' windows are then 6 batches (a set under 8 batches is not grouped)
    shapes = [(40, 400), (400, 40), (64, 64), (300, 100), (100, 300), (500, 125), (64, 200), (90, 60)] * 12
    images = [{"bytes": encoded(photo(w, h, i)), "path": None} for i, (w, h) in enumerate(shapes)]
    captions = [f"a photo {w} wide and {h} high" for w, h in shapes]
    data = datasets.Dataset.from_dict({"image": images, "caption": captions}).cast_column("image", datasets.Image())
    datasets.DatasetDict({"train": data, "validation": data.select(range(8))}).save_to_disk(str(tmp_path / "data"))
    shares = {}
    for strategy in ("random", "group_by_length"):
        out = tmp_path / strategy
        assert main(["train", "--model_preset", "siglip2-tiny", "--dataset_name", str(tmp_path / "data"),
                     "--output_dir", str(out), "--max_steps", "6", "--per_device_train_batch_size", "4",
                     "--train_sampling_strategy", strategy, "--save_strategy", "no", "--report_to", "none",
                     "--dataloader_num_workers", "0", "--seed", "3", "--do_train", "--do_eval"]) == 0  # fmt: skip
        results = json.loads((out / "all_results.json").read_text())
        shares[strategy] = results["train_padded_patch_share"]
        assert results["eval_num_samples"] == 8  # evaluation reads its split whole, in order, either way
    assert 0 <= shares["group_by_length"] < shares["random"] / 2, shares


def test_grouping_the_images_of_a_model_of_one_image_size_is_refused_in_one_line(tmp_path) -> None:
    training = VlfitTrainingArguments(output_dir=str(tmp_path), train_sampling_strategy="group_by_length",
                                      report_to="none")  # fmt: skip
    inputs = resolve_model(model_preset="clip-tiny", captions=lambda: ["a cat"] * 4).inputs
    with pytest.raises(ConfigError, match=r"^--train_sampling_strategy group_by_length groups a NaFlex .* drop the"):
        check_train_sampling(inputs, training)
    check_train_sampling(resolve_model(model_preset="siglip2-tiny", captions=lambda: ["a cat"] * 4).inputs, training)


def test_orders_the_run_cannot_keep_are_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match="^--train_sampling_strategy batch_rebalance .* group_by_length"):
        VlfitTrainingArguments(output_dir=str(tmp_path), train_sampling_strategy="batch_rebalance", report_to="none")
    grouped = VlfitTrainingArguments(output_dir=str(tmp_path), train_sampling_strategy="group_by_length",
                                     report_to="none")  # fmt: skip
    model = ModelArguments(model_preset="siglip2-tiny")
    refusals = {
        "^--train_sampling_strategy group_by_length with --caption_sampling one_per_image": DataArguments(
            dataset_name=str(tmp_path), caption_sampling="one_per_image"),
        "^--train_sampling_strategy group_by_length needs a map-style training split": DataArguments(
            dataset_name=str(tmp_path), streaming=True),
    }  # fmt: skip
    for message, data in refusals.items():
        with pytest.raises(ConfigError, match=message):
            check_flag_rules(model, data, grouped, task="retrieval")
    named = VlfitTrainingArguments(output_dir=str(tmp_path), length_column_name="n", report_to="none")
    with pytest.raises(ConfigError, match="^--length_column_name n: vlfit reads each image's patch count from its"):
        check_flag_rules(model, DataArguments(dataset_name=str(tmp_path)), named, task="retrieval")
    check_flag_rules(model, DataArguments(dataset_name=str(tmp_path)), grouped, task="retrieval")
    (tmp_path / "clip").mkdir()
    (tmp_path / "clip" / "config.json").write_text(json.dumps({"model_type": "clip"}))
    folder = str(tmp_path / "clip")
    square = {"--model_preset clip-tiny takes": ModelArguments(model_preset="clip-tiny"),
              f"--model_name_or_path {folder} takes": ModelArguments(model_name_or_path=folder)}  # fmt: skip
    for message, model in square.items():  # known before anything loads: refused with the other flag rules
        with pytest.raises(ConfigError, match=f"^--train_sampling_strategy group_by_length groups .*; {message} every"):
            check_flag_rules(model, DataArguments(dataset_name=str(tmp_path)), grouped, task="retrieval")
