"""Tests for vlfit.data.pipeline and vlfit.data.batch: the one object that turns a source into model-ready batches."""

from __future__ import annotations

import logging
import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch

from tests.data.test_dataset import CAPTIONS, SIZE, FakeSource
from vlfit.data.batch import BY_VALUE_BYTES, DEVICE, WORKER, BadSample, Batch
from vlfit.data.image_transforms import FastImageTransform, PassThroughEncoded, ReferenceImageTransform, new_image_batch
from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, InputSpec
from vlfit.models.tokenizer import train_caption_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def spec() -> InputSpec:
    tokenizer = train_caption_tokenizer(CAPTIONS * 10, vocab_size=512)
    return InputSpec(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, tokenizer, max_seq_length=32)


def _pipeline(spec: InputSpec, **options) -> InputPipeline:
    return InputPipeline(spec, PipelineOptions(**options), CPU)


def test_the_pipeline_chooses_the_cpu_transform(spec: InputSpec) -> None:
    assert isinstance(_pipeline(spec).image_transform(train=True), FastImageTransform)
    assert isinstance(_pipeline(spec, image_pipeline="reference").image_transform(train=True), ReferenceImageTransform)
    crop = _pipeline(spec, random_resized_crop=True)
    assert crop.image_transform(train=True).random_resized_crop  # type: ignore[union-attr]
    assert not crop.image_transform(train=False).random_resized_crop  # type: ignore[union-attr]
    seam = InputPipeline(spec, PipelineOptions(decode_on_device=True), CPU, cpu_device_decode=True)
    assert isinstance(seam.image_transform(train=True), PassThroughEncoded)


def test_the_pipeline_rejects_unknown_or_contradictory_options(spec: InputSpec) -> None:
    with pytest.raises(ValueError, match=r"'turbo'.*fast, reference"):
        _pipeline(spec, image_pipeline="turbo")
    with pytest.raises(ValueError, match="random_resized_crop"):
        _pipeline(spec, image_pipeline="reference", random_resized_crop=True)


def test_device_decode_without_a_gpu_falls_back_to_the_cpu_pipeline(spec: InputSpec, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        pipeline = _pipeline(spec, decode_on_device=True)
    assert not pipeline.options.decode_on_device and pipeline.description == "fast"
    assert isinstance(pipeline.image_transform(train=True), FastImageTransform)
    assert "needs an NVIDIA GPU" in caplog.text


def test_training_datasets_substitute_and_evaluation_datasets_leave_out(spec: InputSpec) -> None:
    pipeline = _pipeline(spec)
    assert pipeline.dataset(FakeSource(), train=True).substitute
    assert not pipeline.dataset(FakeSource(), train=False).substitute


def test_loader_with_workers_yields_batches_the_feed_normalizes(spec: InputSpec) -> None:
    pipeline = _pipeline(spec)
    loader = pipeline.loader(
        pipeline.dataset(FakeSource(8), train=False),
        batch_size=3,
        settings=LoaderSettings(num_workers=2, prefetch_factor=1, drop_last=True),
    )
    host = list(loader)
    assert [len(batch) for batch in host] == [3, 3]  # drop_last honoured
    assert all(isinstance(b, Batch) and b["pixel_values"].dtype == torch.uint8 for b in host)
    assert host[1].columns["label"] == [3, 4, 5]  # evaluation columns carried
    feed = pipeline.feed(host, torch.float32, train=False)
    staged = list(feed)
    assert all(batch.on_device for batch in staged) and feed.last_wait >= 0
    expected = (host[0]["pixel_values"].float() / 255 - torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(
        OPENAI_CLIP_STD
    ).view(1, 3, 1, 1)
    torch.testing.assert_close(staged[0]["pixel_values"], expected)
    assert staged[0]["pixel_values"].is_contiguous()
    assert staged[0].sample_ids == host[0].sample_ids and staged[0].positions == [0, 1, 2]


def test_an_empty_batch_passes_the_feed_with_its_bad_samples(spec: InputSpec) -> None:
    pipeline = _pipeline(spec)
    empty = Batch.empty([BadSample("x", "caption is empty")])
    (staged,) = list(pipeline.feed([empty], torch.float32, train=True))
    assert len(staged) == 0 and staged.on_device and staged.bad_samples == [BadSample("x", "caption is empty")]
    assert pipeline.to_device(staged, torch.float32, train=True) is staged


def test_loader_settings_follow_the_training_arguments() -> None:
    args = SimpleNamespace(
        dataloader_num_workers=3,
        dataloader_prefetch_factor=4,
        dataloader_pin_memory=True,
        dataloader_persistent_workers=True,
        dataloader_multiprocessing_context=None,
        dataloader_in_order=True,
        dataloader_drop_last=True,
        device=CPU,
    )
    settings = LoaderSettings.from_training_args(args)
    assert (settings.num_workers, settings.prefetch_factor, settings.drop_last) == (3, 4, True)
    assert not settings.pin_memory  # pinned memory only helps copies to a GPU
    assert not LoaderSettings.from_training_args(args, drop_last=False).drop_last


def test_batch_select_keeps_rows_of_every_per_sample_field() -> None:
    batch = Batch(
        inputs={"input_ids": torch.arange(8).view(4, 2), "pixel_values": torch.arange(4).view(4, 1, 1, 1)},
        sample_ids=["a", "b", "c", "d"],
        positions=[10, 11, 12, 13],
        bad_samples=[BadSample("z", "bad", DEVICE)],
        columns={"label": [0, 1, 2, 3]},
    )
    kept = batch.select([0, 2])
    assert kept.sample_ids == ["a", "c"] and kept.positions == [10, 12] and kept.columns == {"label": [0, 2]}
    assert kept["input_ids"].tolist() == [[0, 1], [4, 5]] and kept["pixel_values"].flatten().tolist() == [0, 2]
    assert kept.bad_samples == batch.bad_samples and len(kept) == 2
    assert "input_ids" in batch and "labels" not in batch  # what the Trainer asks of a batch
    moved = batch.to(CPU)
    assert moved is not batch and torch.equal(moved["input_ids"], batch["input_ids"])
    assert BadSample("a", "r").stage == WORKER


def test_a_batch_crossing_to_another_process_sends_its_small_tensors_by_value() -> None:
    # What a loader worker's result queue does to a batch: torch sends a tensor's storage as a shared-memory file
    # descriptor, which the receiver fetches from the worker in a round trip; small tensors go inside the pickle.
    small_pixels = new_image_batch(2, 8, shared=True)
    small_pixels.copy_(torch.randint(0, 256, small_pixels.shape, dtype=torch.uint8))
    large = new_image_batch(2, 1 + int((BY_VALUE_BYTES / 6) ** 0.5), shared=True)
    inputs = {
        "input_ids": torch.arange(10).view(2, 5),
        "pixel_values": small_pixels,
        "large": large.fill_(7),
        "bf16": torch.ones(2, 3, dtype=torch.bfloat16),  # NumPy has no bfloat16: shared memory
    }
    batch = Batch(inputs=inputs, sample_ids=["a", "b"], positions=[0, 1], columns={"label": [1, 0]})
    received = pickle.loads(ForkingPickler.dumps(batch))
    shared = {key: value.is_shared() for key, value in received.inputs.items()}
    assert shared == {"input_ids": False, "pixel_values": False, "large": True, "bf16": True}
    for key, value in inputs.items():
        assert torch.equal(received[key], value) and received[key].stride() == value.stride(), key
    assert received.sample_ids == ["a", "b"] and received.columns == {"label": [1, 0]}
