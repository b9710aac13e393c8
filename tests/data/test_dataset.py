"""Tests for vlfit.data.dataset: the map-style dataset and the collator that makes a ``Batch``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.data.image_factory import jpeg_bytes, png_rgb_bytes
from vlfit.data.bad_samples import BadSampleError
from vlfit.data.batch import Batch
from vlfit.data.dataset import ImageTextCollator, ImageTextDataset
from vlfit.data.decode import DecodeError
from vlfit.data.image_transforms import EncodedImage, FastImageTransform, PassThroughEncoded, ReferenceImageTransform
from vlfit.data.records import Record
from vlfit.data.worker_memory import BY_VALUE_BYTES
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vlfit.models.tokenizer import train_caption_tokenizer

SIZE = 32
CAPTIONS = [
    "a red square on a white background",
    "a green circle next to a blue triangle",
    "two yellow stars above a purple line",
    "an orange ring",  # None, "" and whitespace captions are bad samples: see tests/robustness
    "three small dots",
    "a very long caption " + "with many many words " * 20,
]


class FakeSource:
    """The part of ImageTextSource the dataset uses: ``len`` and indexing into Records."""

    def __init__(self, n: int = 6) -> None:
        self.records = [
            Record(
                id=f"id{i}",
                image=(jpeg_bytes if i % 2 == 0 else png_rgb_bytes)(40 + 8 * i, 30 + 4 * i, seed=i),
                caption=CAPTIONS[i % len(CAPTIONS)],
                extra={"label": i, "caption_choices": [f"choice {i}", "other"]},
            )
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Record:
        return self.records[index]


class ThreadCountingTransform:
    """Wraps a transform and records the torch thread count of the process that ran it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, data: bytes, sample_id: str = "?") -> torch.Tensor:
        image = self.inner(data, sample_id)
        return torch.cat([image.flatten(), torch.tensor([torch.get_num_threads()], dtype=image.dtype)])


@pytest.fixture(scope="module")
def tokenizer():
    captions = [c for c in CAPTIONS if c] * 10
    return train_caption_tokenizer(captions, vocab_size=512)


def _transform(pipeline: str, decode_on_device: bool = False):
    if decode_on_device:
        return PassThroughEncoded()
    if pipeline == "fast":
        return FastImageTransform(SIZE)
    return ReferenceImageTransform(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)


# ---------------------------------------------------------------------------------------------- dataset


def test_dataset_sample_fields() -> None:
    source = FakeSource()
    dataset = ImageTextDataset(source, _transform("fast"))
    assert len(dataset) == 6
    sample = dataset[2]
    assert sample.id == "id2" and sample.position == 2 and sample.bad_samples == []
    assert sample.caption == CAPTIONS[2]
    assert sample.columns["label"] == 2 and sample.columns["caption_choices"] == ["choice 2", "other"]
    assert sample.image.shape == (3, SIZE, SIZE) and sample.image.dtype == torch.uint8
    assert torch.equal(sample.image, FastImageTransform(SIZE)(source[2].image))


def test_dataset_propagates_decode_errors_with_the_id() -> None:
    source = FakeSource(2)
    source.records[1] = Record(id="broken-1", image=b"\xff\xd8\xff nope", caption="x")
    dataset = ImageTextDataset(source, _transform("fast"), bad_sample_policy="raise")
    with pytest.raises(BadSampleError, match="broken-1") as caught:
        dataset[1]
    assert isinstance(caught.value.__cause__, DecodeError)


def test_a_batch_of_samples_is_written_into_one_tensor_the_collator_takes(tokenizer) -> None:
    dataset = ImageTextDataset(FakeSource(), _transform("fast"))
    samples = dataset.__getitems__(list(range(6)))
    assert [sample.id for sample in samples] == [f"id{i}" for i in range(6)]
    for i, sample in enumerate(samples):
        assert torch.equal(sample.image, dataset[i].image)
    batch = ImageTextCollator(tokenizer, 32)(samples)
    assert batch["pixel_values"].data_ptr() == samples[0].image.data_ptr()  # the dataset's tensor, not a copy
    assert not batch["pixel_values"].is_shared()  # in the main process (no worker): plain memory
    assert torch.equal(batch["pixel_values"], torch.stack([dataset[i].image for i in range(6)]))


def test_a_substitute_takes_the_row_of_the_bad_sample_and_a_placeholder_is_left_out(tokenizer) -> None:
    source = FakeSource(4)
    source.records[1] = Record(id="broken-1", image=b"\xff\xd8\xff nope", caption="x")
    training = ImageTextDataset(source, _transform("fast"), substitute=True)
    samples = training.__getitems__([0, 1, 2])
    assert samples[1].id != "broken-1" and [bad.id for bad in samples[1].bad_samples] == ["broken-1"]
    assert torch.equal(samples[1].image, FastImageTransform(SIZE)(source[int(samples[1].id[2:])].image))
    batch = ImageTextCollator(tokenizer, 32)(samples)
    assert batch["pixel_values"].data_ptr() == samples[0].image.data_ptr() and len(batch) == 3

    evaluation = ImageTextDataset(source, _transform("fast"), substitute=False)
    samples = evaluation.__getitems__([0, 1, 2])
    batch = ImageTextCollator(tokenizer, 32)(samples)
    assert batch.sample_ids == ["id0", "id2"] and [bad.id for bad in batch.bad_samples] == ["broken-1"]
    assert torch.equal(batch["pixel_values"], torch.stack([samples[0].image, samples[2].image]))


def test_a_batch_made_in_a_worker_is_in_shared_memory_when_large_with_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vlfit.data import dataset as dataset_module

    class Info:
        id = 0

    calls: list[int] = []
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: Info())
    monkeypatch.setattr(dataset_module.torch, "set_num_threads", calls.append)
    samples = ImageTextDataset(FakeSource(2), _transform("fast")).__getitems__([0, 1])
    assert calls == [1]
    assert not any(sample.image.is_shared() for sample in samples)  # a small batch crosses by value
    side = 1 + int((BY_VALUE_BYTES / 6) ** 0.5)  # two images of this side: too large to cross by value
    samples = ImageTextDataset(FakeSource(2), FastImageTransform(side)).__getitems__([0, 1])
    assert all(sample.image.is_shared() for sample in samples)  # crosses to the main process without a copy


# ---------------------------------------------------------------------------------------------- collator


def _batch(tokenizer, pipeline: str, decode_on_device: bool = False, **collator_kwargs) -> Batch:
    dataset = ImageTextDataset(FakeSource(), _transform(pipeline, decode_on_device))
    collator = ImageTextCollator(tokenizer, collator_kwargs.pop("max_seq_length", 64), **collator_kwargs)
    return collator([dataset[i] for i in range(len(dataset))])


def test_collator_fast_batch(tokenizer) -> None:
    batch = _batch(tokenizer, "fast")
    assert isinstance(batch, Batch) and len(batch) == 6 and not batch.on_device
    assert set(batch.inputs) == {"input_ids", "attention_mask", "pixel_values", "image_keys"}
    assert batch["image_keys"].tolist() == [record.image_key for record in FakeSource().records]
    assert len(set(batch["image_keys"].tolist())) == 6  # six different images
    assert batch.positions == list(range(6))
    assert batch.bad_samples == [] and batch.encoded_images is None and batch.columns == {}
    assert batch["pixel_values"].shape == (6, 3, SIZE, SIZE)
    assert batch["pixel_values"].dtype == torch.uint8
    assert batch["pixel_values"].is_contiguous(memory_format=torch.channels_last)  # stacked as HWC, no transpose
    assert batch.sample_ids == [f"id{i}" for i in range(6)]
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].shape == batch["attention_mask"].shape


def test_collator_reference_batch(tokenizer) -> None:
    batch = _batch(tokenizer, "reference")
    assert batch["pixel_values"].shape == (6, 3, SIZE, SIZE)
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["pixel_values"].min() < 0  # normalized


def test_collator_device_decode_batch(tokenizer) -> None:
    batch = _batch(tokenizer, "fast", decode_on_device=True)
    assert "pixel_values" not in batch
    images = batch.encoded_images
    assert isinstance(images, list) and len(images) == 6
    assert all(isinstance(image, EncodedImage) for image in images)
    assert [image.sample_id for image in images] == batch.sample_ids
    assert images[0].data == FakeSource()[0].image


@pytest.mark.parametrize("max_seq_length", [16, 64, 128])
def test_collator_pads_to_multiple_of_8_and_truncates(tokenizer, max_seq_length: int) -> None:
    batch = _batch(tokenizer, "fast", max_seq_length=max_seq_length)
    length = batch["input_ids"].shape[1]
    assert length % 8 == 0
    assert length <= max_seq_length
    lengths = batch["attention_mask"].sum(dim=1)
    assert int(lengths.max()) <= max_seq_length
    assert length - int(lengths.max()) < 8  # padded to the longest, not to max_seq_length
    # Padding is the pad token, and the long caption was cut.
    pad = tokenizer.pad_token_id
    for row, n in zip(batch["input_ids"], lengths.tolist(), strict=True):
        assert (row[n:] == pad).all()
    assert int(lengths[5]) == min(max_seq_length, len(tokenizer(CAPTIONS[5])["input_ids"]))


@pytest.mark.parametrize("max_seq_length", [7, 50, 77])
def test_collator_accepts_lengths_not_multiple_of_8(tokenizer, max_seq_length: int) -> None:
    batch = _batch(tokenizer, "fast", max_seq_length=max_seq_length)
    assert batch["input_ids"].shape[1] <= max_seq_length
    assert int(batch["attention_mask"].sum(dim=1).max()) <= max_seq_length


def test_collator_short_batch_is_not_padded_to_max(tokenizer) -> None:
    collator = ImageTextCollator(tokenizer, 128)
    dataset = ImageTextDataset(FakeSource(), _transform("fast"))
    batch = collator([dataset[0], dataset[1]])
    assert batch["input_ids"].shape[1] == 16  # two short captions: the longest rounded up to 8, far below 128


def test_collator_none_caption_is_empty_text(tokenizer) -> None:
    dataset = ImageTextDataset(FakeSource(), _transform("fast"))
    collator = ImageTextCollator(tokenizer, 64)
    none_sample, empty_sample = dataset[3], dataset[4]
    none_sample.caption, empty_sample.caption = None, ""
    none_batch = collator([none_sample])
    empty_batch = collator([empty_sample])
    assert torch.equal(none_batch["input_ids"], empty_batch["input_ids"])
    expected = tokenizer("")["input_ids"]
    n = int(none_batch["attention_mask"][0].sum())
    assert none_batch["input_ids"][0, :n].tolist() == expected


def test_collator_keep_columns(tokenizer) -> None:
    batch = _batch(tokenizer, "fast", keep_columns=("label", "caption_choices", "missing"))
    assert batch.columns["label"] == list(range(6))
    assert batch.columns["caption_choices"][3] == ["choice 3", "other"]
    assert batch.columns["missing"] == [None] * 6


# ---------------------------------------------------------------------------------------------- DataLoader


def test_dataloader_with_workers(tokenizer) -> None:
    dataset = ImageTextDataset(FakeSource(8), ThreadCountingTransform(_transform("fast")))
    loader = DataLoader(
        dataset, batch_size=4, num_workers=2, collate_fn=ImageTextCollator(tokenizer, 32, keep_columns=("label",))
    )
    batches = list(loader)
    assert len(batches) == 2
    ids = [sample_id for batch in batches for sample_id in batch.sample_ids]
    assert ids == [f"id{i}" for i in range(8)]
    assert [label for batch in batches for label in batch.columns["label"]] == list(range(8))
    for batch in batches:
        pixels = batch["pixel_values"]
        assert pixels.dtype == torch.uint8 and pixels.shape == (4, 3 * SIZE * SIZE + 1)
        assert (pixels[:, -1] == 1).all(), "workers must run with one torch thread"
        images = pixels[:, :-1].view(4, 3, SIZE, SIZE)
        assert images.float().std() > 0


def test_dataloader_with_workers_batches_the_fast_transforms_images(tokenizer) -> None:
    dataset = ImageTextDataset(FakeSource(8), _transform("fast"))
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=ImageTextCollator(tokenizer, 32))
    batches = list(loader)
    assert [batch.sample_ids for batch in batches] == [[f"id{i}" for i in range(j, j + 4)] for j in (0, 4)]
    for start, batch in zip((0, 4), batches, strict=True):
        expected = torch.stack([dataset[i].image for i in range(start, start + 4)])
        assert torch.equal(batch["pixel_values"], expected)
        assert batch["pixel_values"].is_contiguous(memory_format=torch.channels_last)


def test_dataset_limits_threads_only_in_workers() -> None:
    threads = torch.get_num_threads()
    dataset = ImageTextDataset(FakeSource(1), _transform("fast"))
    dataset[0]
    assert torch.get_num_threads() == threads


def test_dataset_sets_one_thread_once_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset's own limit (torch's worker loop sets one too; this checks the dataset does not rely on it)."""
    from vlfit.data import dataset as dataset_module

    pid = [1000]
    calls: list[int] = []
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: object())  # as in a loader worker
    monkeypatch.setattr(dataset_module, "_set_up_in", None)
    monkeypatch.setattr(dataset_module.os, "getpid", lambda: pid[0])
    monkeypatch.setattr(dataset_module.multiprocessing, "parent_process", lambda: None)  # no setsid here
    monkeypatch.setattr(dataset_module.torch, "set_num_threads", calls.append)
    dataset = ImageTextDataset(FakeSource(2), _transform("fast"))
    dataset[0]
    dataset[1]
    assert calls == [1]
    pid[0] = 1001  # another worker process
    dataset[0]
    assert calls == [1, 1]
