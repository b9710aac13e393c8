"""Tests for vlfit.data.device_stage on CPU tensors (the same code runs on CUDA), plus CUDA-only checks.

The device decode itself (decode_resize_batch) is tested in test_device_decode.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.data.test_device_decode import mixed_batch
from vlfit.data.batch import Batch
from vlfit.data.device_decode import decode_resize_batch
from vlfit.data.device_stage import (
    CudaPrefetcher,
    DeviceStage,
    ReusedBuffers,
    random_horizontal_flip,
)
from vlfit.data.image_transforms import EncodedImage
from vlfit.data.normalize import normalize_uint8
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

MEAN = torch.tensor(OPENAI_CLIP_MEAN)
STD = torch.tensor(OPENAI_CLIP_STD)
SIZE = 48

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def random_uint8(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- flip


def test_random_horizontal_flip_flips_exactly_the_drawn_images() -> None:
    pixels = random_uint8(64, 3, 4, 6, seed=1)
    out = random_horizontal_flip(pixels, generator=torch.Generator().manual_seed(123))
    drawn = torch.rand(64, generator=torch.Generator().manual_seed(123)) < 0.5
    flipped = pixels.flip(-1)
    assert out.shape == pixels.shape and out.dtype == pixels.dtype
    for i in range(64):
        assert torch.equal(out[i], flipped[i] if drawn[i] else pixels[i])
        assert not torch.equal(flipped[i], pixels[i])  # so "flipped or not" is decidable
    assert 0 < int(drawn.sum()) < 64
    assert torch.equal(pixels, random_uint8(64, 3, 4, 6, seed=1))  # input untouched


def test_random_horizontal_flip_is_reproducible_and_works_on_float() -> None:
    pixels = torch.randn(16, 3, 5, 5)
    a = random_horizontal_flip(pixels, generator=torch.Generator().manual_seed(7))
    b = random_horizontal_flip(pixels, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    same = [torch.equal(a[i], pixels[i]) for i in range(16)]
    mirrored = [torch.equal(a[i], pixels[i].flip(-1)) for i in range(16)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True))


# ---------------------------------------------------------------------------------------------- DeviceStage


def _batch(pixels: torch.Tensor | None = None, encoded: list[EncodedImage] | None = None) -> Batch:
    size = len(pixels) if pixels is not None else len(encoded or [])
    inputs = {
        "input_ids": torch.arange(size * 8).view(size, 8),
        "attention_mask": torch.ones(size, 8, dtype=torch.long),
    }
    if pixels is not None:
        inputs["pixel_values"] = pixels
    ids = [f"s{i}" for i in range(size)]
    return Batch(inputs=inputs, sample_ids=ids, positions=list(range(size)), encoded_images=encoded)


def test_device_stage_normalizes_uint8_to_model_dtype() -> None:
    pixels = random_uint8(4, 3, SIZE, SIZE, seed=3)
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    batch = _batch(pixels)
    out = stage(batch, torch.device("cpu"), torch.bfloat16, train=False)
    assert out["pixel_values"].dtype == torch.bfloat16 and out.on_device and not batch.on_device
    assert out["pixel_values"].shape == (4, 3, SIZE, SIZE)
    expected = normalize_uint8(pixels, MEAN, STD, torch.float32)
    torch.testing.assert_close(out["pixel_values"].float(), expected, atol=2e-2, rtol=1e-2)
    assert out.sample_ids == ["s0", "s1", "s2", "s3"]
    assert torch.equal(out["input_ids"], batch["input_ids"])
    assert batch["pixel_values"] is pixels  # the input batch is not modified
    assert out is not batch


def test_device_stage_leaves_reference_pixels_normalized_as_they_were() -> None:
    pixels = torch.randn(3, 3, SIZE, SIZE)
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    out = stage(_batch(pixels), torch.device("cpu"), torch.float32, train=False)
    assert torch.equal(out["pixel_values"], pixels)
    out = stage(_batch(pixels), torch.device("cpu"), torch.bfloat16, train=False)
    assert torch.equal(out["pixel_values"], pixels.to(torch.bfloat16))


def test_device_stage_decodes_encoded_images() -> None:
    images = mixed_batch()[:4]
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    batch = _batch(encoded=images)
    out = stage(batch, torch.device("cpu"), torch.float32, train=False)
    assert out.encoded_images is None and len(out) == 4
    assert batch.encoded_images is images  # the input batch is not modified
    expected = normalize_uint8(decode_resize_batch(images, SIZE, "cpu"), MEAN, STD, torch.float32)
    assert torch.equal(out["pixel_values"], expected)


def test_device_stage_moves_tensors_to_the_device() -> None:
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, horizontal_flip=True)
    batch = _batch(random_uint8(2, 3, 8, 8))
    meta = torch.device("meta")  # a device that is not the CPU, on every machine
    out = stage(batch, meta, torch.bfloat16, train=True)
    assert out["pixel_values"].device == meta and out["pixel_values"].dtype == torch.bfloat16
    assert out["input_ids"].device == meta and out["attention_mask"].device == meta
    assert out.sample_ids == ["s0", "s1"]
    assert batch["pixel_values"].device.type == "cpu"


@pytest.mark.parametrize(("horizontal_flip", "train"), [(True, True), (True, False), (False, True), (False, False)])
def test_device_stage_flips_only_in_training_with_flip(horizontal_flip: bool, train: bool) -> None:
    pixels = random_uint8(64, 3, 4, 6, seed=5)
    expected = normalize_uint8(pixels, MEAN, STD, torch.float32)
    stage = DeviceStage(4, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, horizontal_flip=horizontal_flip)
    torch.manual_seed(0)
    out = stage(_batch(pixels), torch.device("cpu"), torch.float32, train=train)["pixel_values"]
    same = sum(torch.equal(out[i], expected[i]) for i in range(64))
    mirrored = sum(torch.equal(out[i], expected[i].flip(-1)) for i in range(64))
    assert same + mirrored == 64
    if horizontal_flip and train:
        assert 0 < mirrored < 64
    else:
        assert mirrored == 0


# ---------------------------------------------------------------------------------------------- CUDA only


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", ["nchw", "channels_last_pinned"])
def test_cuda_prefetcher_yields_every_batch_staged(layout: str) -> None:
    """As the Trainer feeds it: the CPU stage's channels-last batches, pinned by the DataLoader, or plain NCHW."""
    device = torch.device("cuda")
    stage = DeviceStage(8, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    batches = [_batch(random_uint8(2, 3, 8, 8, seed=i)) for i in range(3)]
    if layout == "channels_last_pinned":
        for batch in batches:
            pixels = batch.inputs["pixel_values"]
            batch.inputs["pixel_values"] = pixels.contiguous(memory_format=torch.channels_last).pin_memory()
    out = list(CudaPrefetcher(iter(batches), stage, device, torch.bfloat16, train=False))
    assert len(out) == 3
    for batch, staged in zip(batches, out, strict=True):
        assert staged.on_device
        assert staged["pixel_values"].device.type == "cuda" and staged["pixel_values"].dtype == torch.bfloat16
        assert staged["pixel_values"].is_contiguous()
        expected = normalize_uint8(batch["pixel_values"], MEAN, STD, torch.float32)
        torch.testing.assert_close(staged["pixel_values"].float().cpu(), expected, atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------- reused buffers


def test_device_stage_on_cpu_reuses_an_output_buffer_only_once_nothing_holds_it() -> None:
    stage = DeviceStage(SIZE, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    cpu = torch.device("cpu")
    batches = [_batch(random_uint8(2, 3, 8, 8, seed=i)) for i in range(6)]
    expected = [normalize_uint8(b["pixel_values"], MEAN, STD, torch.float32) for b in batches]

    first = stage(batches[0], cpu, train=False)["pixel_values"]
    address = first.data_ptr()
    second = stage(batches[1], cpu, train=False)["pixel_values"]
    assert second.data_ptr() != address  # the first batch's pixels are still held
    row = first[1]  # a view keeps the memory held too
    del first
    third = stage(batches[2], cpu, train=False)["pixel_values"]
    assert third.data_ptr() not in (address, second.data_ptr())
    del row
    fourth = stage(batches[3], cpu, train=False)["pixel_values"]
    assert fourth.data_ptr() == address  # nothing holds the first buffer any more: taken again
    for staged, want in zip((second, third, fourth), expected[1:4], strict=True):
        assert torch.equal(staged, want)  # reuse never changed pixels in use

    # A tensor autograd saved for the backward pass holds the memory until the graph is freed.
    weight = torch.ones(1, 3, 1, 1, requires_grad=True)
    loss = (fourth * weight).sum()
    del fourth
    held = [stage(b, cpu, train=False)["pixel_values"] for b in batches[4:6]]
    assert address not in [p.data_ptr() for p in held]
    loss.backward()
    kept = {p.data_ptr() for p in held}
    del loss, held
    again = stage(batches[5], cpu, train=False)["pixel_values"]
    assert again.data_ptr() in kept  # freed: taken again
    assert torch.equal(again, expected[5])


def test_reused_buffers_keep_a_bounded_number() -> None:
    buffers = ReusedBuffers(keep=2)
    held = [buffers.empty(torch.Size([4, 4])) for _ in range(5)]
    assert len({t.data_ptr() for t in held}) == 5  # every one held: five different memories
    assert len(buffers._buffers) == 2
    del held
    a = buffers.empty(torch.Size([4, 4]))
    b = buffers.empty(torch.Size([4, 4]))
    assert a.data_ptr() != b.data_ptr()
    assert buffers.empty(torch.Size([2, 8])).shape == (2, 8)  # another shape: a buffer of its own
