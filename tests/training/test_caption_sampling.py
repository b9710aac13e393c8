"""``--caption_sampling``: an epoch shows every caption once (``every``), or every image once with one of its
captions drawn anew each epoch (``one_per_image``), reproducibly per seed and epoch."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from tests.data.test_several_captions import _caption_lists
from vlfit.cli import main
from vlfit.data.caption_sampling import OneCaptionPerImageSampler
from vlfit.data.image_groups import image_groups
from vlfit.data.sources import ArrowSource


def test_groups_hold_each_images_records_in_order_of_first_appearance() -> None:
    groups = image_groups(np.array([7, -3, 7, 5, -3, 7]))
    assert [group.tolist() for group in groups] == [[0, 2, 5], [1, 4], [3]]


def test_each_epoch_shows_every_image_once_and_draws_its_caption_again() -> None:
    groups = image_groups(np.repeat(np.arange(20), 5))  # 20 images x 5 captions
    sampler = OneCaptionPerImageSampler(groups, seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    for indices in epochs:
        assert len(indices) == len(sampler) == 20 and sorted(i // 5 for i in indices) == list(range(20))
    assert epochs[0] != epochs[1] and {i % 5 for i in epochs[0]} != {0}  # new order, not always caption 0
    resumed = OneCaptionPerImageSampler(groups, seed=3)
    resumed.set_epoch(1)
    assert list(resumed) == epochs[1]  # a resumed run reads what the uninterrupted one read
    assert list(OneCaptionPerImageSampler(groups, seed=4)) != epochs[0]


def test_image_keys_from_the_id_column_equal_the_records_keys() -> None:
    dataset = _caption_lists([["a", "b"], ["c"], ["d", "e", "f"]])
    dataset = dataset.add_column("image_id", ["x", None, "x"])  # a row without an id is known by its bytes
    source = ArrowSource(dataset, name="n", image_column="image", caption_column="captions", image_id_column="image_id")
    for part in (source, source.select([5, 0, 2])):
        assert part.image_keys().tolist() == [record.image_key for record in part]
    keys = source.image_keys()
    assert keys[0] == keys[1] == keys[3] != keys[2]


@pytest.mark.slow
def test_train_one_caption_per_image_makes_an_epoch_of_images(tmp_path: Path) -> None:
    data = _caption_lists([["red", "a red one", "red square"], ["green", "g", "green square"], ["blue", "b", "bb"],
                           ["yellow", "y", "yy"]])  # fmt: skip
    datasets.DatasetDict({"train": data}).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "run"
    assert main(["train", "--model_preset", "tiny", "--dataset_name", str(tmp_path / "data"), "--caption_column",
                 "captions", "--output_dir", str(out), "--num_train_epochs", "2", "--per_device_train_batch_size",
                 "2", "--caption_sampling", "one_per_image", "--save_strategy", "no", "--report_to", "none",
                 "--dataloader_num_workers", "0"]) == 0  # fmt: skip
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4  # 2 epochs x 4 images / 2 per batch (every caption: 12)
