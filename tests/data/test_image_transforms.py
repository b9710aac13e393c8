"""Tests for vlfit.data.image_transforms: shapes, random resized crop, and fast-vs-reference equivalence."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.data.image_factory import (
    cmyk_jpeg_bytes,
    exif_jpeg_bytes,
    jpeg_bytes,
    png_rgb_bytes,
    png_rgba_bytes,
    psnr,
    textured_array,
)
from vlfit.data.decode import DecodeError, decode_pil
from vlfit.data.image_transforms import (
    EncodedImage,
    FastImageTransform,
    PassThroughEncoded,
    ReferenceImageTransform,
    hwc_to_chw_view,
    new_image_batch,
    resize_crop_uint8,
    stack_images,
)
from vlfit.data.normalize import normalize_uint8
from vlfit.data.worker_memory import BY_VALUE_BYTES
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

MEAN = torch.tensor(OPENAI_CLIP_MEAN)
STD = torch.tensor(OPENAI_CLIP_STD)
MIN_PSNR_DB = 30.0


def to_unit_range(normalized: torch.Tensor) -> np.ndarray:
    """Undo CLIP normalization of a ``[3, H, W]`` tensor: back to pixel space in [0, 1]."""
    return (normalized.float() * STD.view(3, 1, 1) + MEAN.view(3, 1, 1)).clamp(0, 1).numpy()


def fast_vs_reference_psnr(data: bytes, size: int) -> float:
    fast = FastImageTransform(size)(data)
    reference = ReferenceImageTransform(size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)(data)
    fast_normalized = normalize_uint8(fast.unsqueeze(0), MEAN, STD, torch.float32)[0]
    assert fast_normalized.shape == reference.shape == (3, size, size)
    return psnr(to_unit_range(fast_normalized), to_unit_range(reference))


# ---------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("width", "height"),
    [(640, 480), (480, 640), (300, 300), (4000, 20), (20, 4000), (1, 1), (3, 1000), (50, 40)],
    ids=["landscape", "portrait", "square", "extreme-wide", "extreme-tall", "one-pixel", "sliver", "smaller"],
)
@pytest.mark.parametrize("size", [32, 64, 97])
def test_fast_transform_shape_and_dtype(width: int, height: int, size: int) -> None:
    data = jpeg_bytes(width, height, quality=85, subsampling=2)
    out = FastImageTransform(size)(data)
    assert out.shape == (3, size, size)
    assert out.dtype == torch.uint8
    assert out.permute(1, 2, 0).is_contiguous()  # an HWC buffer: stack_images batches it without a transpose
    crop = FastImageTransform(size, random_resized_crop=True)(data)
    assert crop.shape == (3, size, size)
    assert crop.dtype == torch.uint8


@pytest.mark.parametrize(("width", "height"), [(640, 480), (480, 640), (4000, 20), (1, 1)])
def test_reference_transform_shape_and_dtype(width: int, height: int) -> None:
    out = ReferenceImageTransform(48, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)(jpeg_bytes(width, height, quality=85))
    assert out.shape == (3, 48, 48)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("make", [png_rgb_bytes, png_rgba_bytes, cmyk_jpeg_bytes])
def test_fast_transform_other_formats(make) -> None:
    out = FastImageTransform(32)(make(80, 60))
    assert out.shape == (3, 32, 32)
    assert out.dtype == torch.uint8


def test_fast_transform_errors_name_the_sample() -> None:
    with pytest.raises(DecodeError, match="sample x-9"):
        FastImageTransform(32)(b"\xff\xd8\xff\xe0 definitely not a jpeg", "x-9")
    with pytest.raises(DecodeError, match="sample x-9"):
        ReferenceImageTransform(32, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)(b"garbage", "x-9")


def test_random_resized_crop_varies_and_stays_in_bounds() -> None:
    torch.manual_seed(0)
    transform = FastImageTransform(32, random_resized_crop=True, scale=(0.2, 0.5))
    data = jpeg_bytes(200, 150)
    outputs = [transform(data) for _ in range(6)]
    assert all(out.shape == (3, 32, 32) for out in outputs)
    assert any(not torch.equal(outputs[0], out) for out in outputs[1:])
    center = FastImageTransform(32)(data)
    assert all(not torch.equal(center, out) for out in outputs)


def test_resize_crop_uint8_center_crop_matches_float_path() -> None:
    array = textured_array(90, 60)
    image = hwc_to_chw_view(array)
    assert image.shape == (3, 60, 90)
    out = resize_crop_uint8(image, 40)
    expected = torch.nn.functional.interpolate(
        torch.from_numpy(array).permute(2, 0, 1)[None].float(), size=(40, 60), mode="bicubic", antialias=True
    )[0, :, :, 10:50]
    assert out.shape == (3, 40, 40)
    assert (out.float() - expected.clamp(0, 255)).abs().max() <= 1.0


def test_resize_crop_uint8_crop_box() -> None:
    array = textured_array(100, 80)
    image = hwc_to_chw_view(array)
    out = resize_crop_uint8(image, 20, crop_box=(10, 30, 20, 20))  # a 20x20 box: resize is the identity
    np.testing.assert_array_equal(out.permute(1, 2, 0).numpy(), array[10:30, 30:50])
    # Identity without a box either, when the image already has the model size.
    square = hwc_to_chw_view(textured_array(24, 24))
    assert torch.equal(resize_crop_uint8(square, 24), square.contiguous())


@pytest.mark.parametrize("box", [None, (3, 17, 41, 52)])
def test_resize_crop_uint8_is_the_same_in_every_layout(box) -> None:
    """Channels-last (the CPU fast path) and contiguous CHW (nvJPEG's layout) give identical pixels."""
    array = textured_array(97, 61)
    channels_last = resize_crop_uint8(hwc_to_chw_view(array), 33, box)
    chw = resize_crop_uint8(hwc_to_chw_view(array).contiguous(), 33, box)
    assert channels_last.permute(1, 2, 0).is_contiguous()
    assert chw.is_contiguous()
    assert torch.equal(channels_last, chw)


def test_resize_crop_uint8_matches_torchvision_resize() -> None:
    """The CPU path calls torch's kernel directly; it must be what torchvision's uint8 resize gives: the short side
    resized, then the central square cut (offsets rounded down), as a saved folder's image processor does."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2.functional import resize

    array = textured_array(160, 120)
    expected = resize(
        torch.from_numpy(array).permute(2, 0, 1).contiguous(),
        [50, 66],  # 66 = int(50 * 160 / 120)
        interpolation=InterpolationMode.BICUBIC,
        antialias=True,
    )[:, :, 8:58]
    assert torch.equal(resize_crop_uint8(hwc_to_chw_view(array), 50), expected)


def test_stack_images_keeps_channels_last_and_values() -> None:
    images = [resize_crop_uint8(hwc_to_chw_view(textured_array(40 + i, 30, seed=i)), 16) for i in range(4)]
    batch = stack_images(images)
    assert batch.shape == (4, 3, 16, 16)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(batch, torch.stack([image.contiguous() for image in images]))


def test_stack_images_other_layouts_stack_as_usual() -> None:
    chw = [torch.randn(3, 5, 7) for _ in range(3)]
    batch = stack_images(chw)
    assert batch.is_contiguous()
    assert torch.equal(batch, torch.stack(chw))
    mixed = [hwc_to_chw_view(textured_array(7, 5)), torch.zeros(3, 5, 7, dtype=torch.uint8)]
    assert torch.equal(stack_images(mixed), torch.stack(mixed))


@pytest.mark.parametrize("box", [None, (3, 5, 20, 24)])
@pytest.mark.parametrize("size", [16, 30])  # 30: the central square is the output size already (crop only)
def test_resize_crop_uint8_into_a_batch_row_gives_the_same_pixels(box, size: int) -> None:
    image = hwc_to_chw_view(textured_array(40, 30, seed=2))
    batch = new_image_batch(3, size)
    row = resize_crop_uint8(image, size, box if size == 16 else None, out=batch[1])
    assert row.data_ptr() == batch[1].data_ptr()  # written in place
    assert torch.equal(batch[1], resize_crop_uint8(image, size, box if size == 16 else None))


def test_stack_images_takes_the_rows_of_one_batch_without_copying() -> None:
    batch = new_image_batch(4, 16)
    for i in range(4):
        resize_crop_uint8(hwc_to_chw_view(textured_array(40 + i, 30, seed=i)), 16, out=batch[i])
    rows = [batch[i] for i in range(4)]
    stacked = stack_images(rows)
    assert stacked.data_ptr() == batch.data_ptr() and stacked.shape == (4, 3, 16, 16)
    assert stacked.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(stacked, torch.stack([row.contiguous() for row in rows]))
    # Not the whole batch in order (a row left out, rows swapped): copied, as any other images.
    for subset in ([rows[0], rows[2], rows[3]], [rows[1], rows[0], rows[2], rows[3]], rows[:3]):
        copied = stack_images(subset)
        assert copied.data_ptr() != batch.data_ptr()
        assert torch.equal(copied, torch.stack([row.contiguous() for row in subset]))


def test_new_image_batch_layout_and_shared_memory() -> None:
    batch = new_image_batch(2, 8)
    assert batch.shape == (2, 3, 8, 8) and batch.dtype == torch.uint8
    assert batch.is_contiguous(memory_format=torch.channels_last) and not batch.is_shared()
    # A loader worker's batch (shared): in shared memory only when it is too large to cross by value.
    assert not new_image_batch(2, 8, shared=True).is_shared()
    side = 1 + int((BY_VALUE_BYTES / 6) ** 0.5)
    large = new_image_batch(2, side, shared=True)
    assert large.is_shared() and large.is_contiguous(memory_format=torch.channels_last)
    assert not new_image_batch(2, side).is_shared()


def test_hwc_to_chw_view_shares_memory() -> None:
    array = np.ascontiguousarray(textured_array(8, 6))
    view = hwc_to_chw_view(array)
    assert view.shape == (3, 6, 8)
    array[0, 0, 0] = 7
    assert view[0, 0, 0] == 7


def test_pass_through_encoded() -> None:
    data = jpeg_bytes(16, 16)
    encoded = PassThroughEncoded()(data, "s7")
    assert isinstance(encoded, EncodedImage)
    assert encoded.data is data and encoded.sample_id == "s7"
    tensor = encoded.tensor()
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1
    assert bytes(tensor.numpy()) == data
    assert not hasattr(encoded, "to")


# ---------------------------------------------------------------------------------------------- equivalence

EQUIVALENCE_SIZES = [(1024, 768), (768, 1024), (600, 600), (1400, 900)]


@functools.cache
def equivalence_jpeg(width: int, height: int) -> bytes:
    """One 4:2:0 JPEG per size, shared by the target sizes."""
    return jpeg_bytes(width, height, quality=90, subsampling=2, seed=width + height)


@pytest.mark.parametrize(("width", "height"), EQUIVALENCE_SIZES)
@pytest.mark.parametrize("size", [64, 128, 294])
def test_fast_matches_reference(width: int, height: int, size: int) -> None:
    assert fast_vs_reference_psnr(equivalence_jpeg(width, height), size) >= MIN_PSNR_DB


@pytest.mark.parametrize("orientation", [6, 7])
def test_fast_matches_reference_with_exif_and_444(orientation: int) -> None:
    data = exif_jpeg_bytes(640, 400, orientation)
    assert fast_vs_reference_psnr(data, 96) >= MIN_PSNR_DB
    assert fast_vs_reference_psnr(jpeg_bytes(640, 400, subsampling=0), 96) >= MIN_PSNR_DB


def test_psnr_check_detects_a_wrong_image() -> None:
    """The equivalence metric must fail on a plausible mistake (a mirrored image), or it proves nothing."""
    data = equivalence_jpeg(1024, 768)
    fast = FastImageTransform(128)(data).flip(-1)
    reference = ReferenceImageTransform(128, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)(data)
    fast_normalized = normalize_uint8(fast.unsqueeze(0), MEAN, STD, torch.float32)[0]
    assert psnr(to_unit_range(fast_normalized), to_unit_range(reference)) < MIN_PSNR_DB


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_a_scaled_decode_is_resampled_where_a_full_decode_lies(orientation: int) -> None:
    """577 rows are 72 DCT blocks and one row: at 1/8, the last decoded row stands for 1 row of the image and 7 of
    padding, and an EXIF turn or flip puts it first. The fast transform resamples the image, not the padding: its
    pixels are those of the full decode resized (mean difference 7.3 when the padding was resampled too)."""
    data = jpeg_bytes(770, 577, quality=90, subsampling=2, seed=1, orientation=orientation)
    full = resize_crop_uint8(hwc_to_chw_view(np.array(decode_pil(data))), 64).float()
    assert float((FastImageTransform(64)(data).float() - full).abs().mean()) < 1.0  # 0.51 measured
    cmyk = cmyk_jpeg_bytes(770, 577)  # Pillow's draft: the same scaled decode
    full = resize_crop_uint8(hwc_to_chw_view(np.array(decode_pil(cmyk))), 64).float()
    assert float((FastImageTransform(64)(cmyk).float() - full).abs().mean()) < 1.0
