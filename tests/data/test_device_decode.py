"""Tests for vlfit.data.device_decode on CPU tensors (the same code runs on CUDA), plus CUDA-only checks.

The behaviour tests run twice: with torchcodec's ``decode_jpeg`` (what a normal install uses) and with the
torchvision fallback taken where torchcodec does not import.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.data.image_factory import (
    cmyk_jpeg_bytes,
    exif_jpeg_bytes,
    grayscale_jpeg_bytes,
    jpeg_bytes,
    png_rgba_bytes,
    progressive_jpeg_bytes,
    psnr,
    webp_bytes,
)
from vlfit.data.decode import DecodeError, apply_orientation
from vlfit.data.device_decode import (
    _orient_chw,
    decode_resize_batch,
    decode_resize_batch_skipping_bad,
    jpeg_decoder,
)
from vlfit.data.image_transforms import EncodedImage, FastImageTransform

SIZE = 48
MIN_PSNR_DB = 30.0
TORCHVISION_DEPRECATION = "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
CORRUPT_JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 64

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def random_uint8(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def mixed_batch() -> list[EncodedImage]:
    """Every kind of input the device stage meets: batched-JPEG, CPU-fallback and EXIF-rotated samples."""
    datas = [
        jpeg_bytes(320, 240, subsampling=2, seed=1),
        progressive_jpeg_bytes(200, 300, seed=2),
        png_rgba_bytes(150, 100, seed=3),
        cmyk_jpeg_bytes(180, 120, seed=4),
        exif_jpeg_bytes(240, 160, 6, seed=5),
        exif_jpeg_bytes(240, 160, 7, seed=6),
        grayscale_jpeg_bytes(100, 80, seed=7),
        webp_bytes(90, 120, seed=8),
    ]
    return [EncodedImage(data, f"s{i}") for i, data in enumerate(datas)]


def oriented_png(data: bytes) -> bytes:
    """Re-encode a JPEG losslessly with Pillow's idea of its EXIF orientation applied (an independent reference)."""
    buffer = io.BytesIO()
    ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _use_torchvision_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``from torchcodec.decoders import ...`` fail, as on a machine without the wheel."""
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    jpeg_decoder.cache_clear()


@pytest.fixture(
    params=["torchcodec", pytest.param("torchvision", marks=pytest.mark.filterwarnings(TORCHVISION_DEPRECATION))]
)
def decoder_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test with torchcodec's decoder, then with the torchvision fallback."""
    if request.param == "torchcodec":
        pytest.importorskip("torchcodec.decoders")
    else:
        _use_torchvision_fallback(monkeypatch)
    jpeg_decoder.cache_clear()
    assert jpeg_decoder().name.startswith(request.param)
    yield request.param
    jpeg_decoder.cache_clear()  # the next test finds torchcodec again, once monkeypatch restores the import


# ---------------------------------------------------------------------------------------------- the decoder


def test_torchcodec_is_the_device_decoder_where_it_imports() -> None:
    pytest.importorskip("torchcodec.decoders")
    jpeg_decoder.cache_clear()
    decoder = jpeg_decoder()
    assert decoder.name == "torchcodec.decoders.decode_jpeg"
    assert decoder.applies_exif_orientation and not decoder.needs_synchronize


def test_torchcodec_turns_pixels_by_exif_orientation_itself() -> None:
    """What ``applies_exif_orientation`` rests on: an orientation-6 JPEG comes back rotated (H and W swapped)."""
    pytest.importorskip("torchcodec.decoders")
    jpeg_decoder.cache_clear()
    data = exif_jpeg_bytes(160, 96, 6, seed=1)
    pixels = jpeg_decoder().decode(EncodedImage(data, "e").tensor(), torch.device("cpu"))
    assert pixels.shape == (3, 160, 96)
    expected = np.asarray(Image.open(io.BytesIO(oriented_png(data))))
    assert psnr(pixels.permute(1, 2, 0).numpy(), expected, peak=255) >= MIN_PSNR_DB


def test_falls_back_to_torchvision_without_torchcodec(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    _use_torchvision_fallback(monkeypatch)
    images = mixed_batch()
    with caplog.at_level(logging.WARNING, logger="vlfit"):
        with pytest.warns(DeprecationWarning, match="TorchCodec"):  # torchvision's decoders are deprecated
            first = decode_resize_batch(images, SIZE, "cpu")
        with pytest.warns(DeprecationWarning):
            decode_resize_batch(images[:2], SIZE, "cpu")
    said = [record.getMessage() for record in caplog.records if record.name == "vlfit.data.device_decode"]
    assert len(said) == 1 and "torchvision.io.decode_jpeg" in said[0] and "torchcodec" in said[0]
    decoder = jpeg_decoder()
    assert decoder.name == "torchvision.io.decode_jpeg" and not decoder.applies_exif_orientation
    jpeg_decoder.cache_clear()
    monkeypatch.undo()
    if jpeg_decoder().name.startswith("torchcodec"):
        # Both libraries bundle libjpeg-turbo: the same pixels, EXIF orientation included.
        assert torch.equal(first, decode_resize_batch(images, SIZE, "cpu"))
    jpeg_decoder.cache_clear()


# ---------------------------------------------------------------------------------------------- orientation


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_chw_matches_apply_orientation(orientation: int) -> None:
    hwc = random_uint8(5, 7, 3, seed=orientation).numpy()
    chw = torch.from_numpy(hwc).permute(2, 0, 1)
    expected = apply_orientation(hwc, orientation)
    np.testing.assert_array_equal(_orient_chw(chw, orientation).permute(1, 2, 0).numpy(), expected)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_decode_resize_batch_applies_exif_orientation(orientation: int, decoder_name: str) -> None:
    data = exif_jpeg_bytes(160, 96, orientation, seed=orientation)
    out = decode_resize_batch([EncodedImage(data, "e"), EncodedImage(jpeg_bytes(64, 64), "plain")], SIZE, "cpu")
    expected = FastImageTransform(SIZE)(oriented_png(data))
    assert psnr(out[0].numpy(), expected.numpy(), peak=255) >= MIN_PSNR_DB


# ---------------------------------------------------------------------------------------------- decode + resize


def test_decode_resize_batch_matches_cpu_transform(decoder_name: str) -> None:
    images = mixed_batch()
    out = decode_resize_batch(images, SIZE, "cpu")
    assert out.shape == (len(images), 3, SIZE, SIZE)
    assert out.dtype == torch.uint8
    fast = FastImageTransform(SIZE)
    for i, image in enumerate(images):
        value = psnr(out[i].numpy(), fast(image.data, image.sample_id).numpy(), peak=255)
        assert value >= MIN_PSNR_DB, f"sample {i}: {value:.1f} dB"


@pytest.mark.parametrize(
    "bad",
    [CORRUPT_JPEG, jpeg_bytes(128, 128)[:3000], b"", b"garbage"],
    ids=["jpeg-magic-garbage", "truncated-jpeg", "empty", "garbage"],
)
def test_decode_resize_batch_names_the_corrupt_sample(bad: bytes, decoder_name: str) -> None:
    images = mixed_batch()[:3]
    images.insert(1, EncodedImage(bad, "bad-7"))
    with pytest.raises(DecodeError, match="sample bad-7"):
        decode_resize_batch(images, SIZE, "cpu")


def test_decode_resize_batch_skipping_bad_reports_index_id_and_reason(decoder_name: str) -> None:
    images = mixed_batch()[:4]
    images.insert(1, EncodedImage(jpeg_bytes(128, 128)[:3000], "cut-1"))
    images.insert(4, EncodedImage(CORRUPT_JPEG, "junk-4"))
    pixels, failed = decode_resize_batch_skipping_bad(images, SIZE, "cpu")
    assert [(i, sample_id) for i, sample_id, _ in failed] == [(1, "cut-1"), (4, "junk-4")]
    assert all(reason and not reason.startswith("sample ") for _, _, reason in failed)  # the id stands apart
    good = [image for image in images if image.sample_id not in ("cut-1", "junk-4")]
    assert torch.equal(pixels, decode_resize_batch(good, SIZE, "cpu"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_decode_resize_batch_outputs_are_not_aliased(device: str) -> None:
    """A batch's pixels survive decoding the next batch (the decoder may reuse its buffers)."""
    first_images = [EncodedImage(jpeg_bytes(96, 64, seed=s), f"a{s}") for s in range(3)]
    first = decode_resize_batch(first_images, SIZE, device)
    kept = first.clone()
    second = decode_resize_batch(
        [EncodedImage(jpeg_bytes(64, 96, seed=s + 10), f"b{s}") for s in range(3)], SIZE, device
    )
    assert torch.equal(first, kept)
    assert first.data_ptr() != second.data_ptr()
    assert not torch.equal(first, second)
    again = decode_resize_batch(first_images, SIZE, device)
    assert torch.equal(again, kept)  # deterministic


def test_decode_resize_batch_does_not_modify_inputs() -> None:
    images = mixed_batch()[:2]
    before = [image.data for image in images]
    decode_resize_batch(images, SIZE, "cpu")
    assert [image.data for image in images] == before


# ---------------------------------------------------------------------------------------------- CUDA only


@pytest.mark.cuda
@needs_cuda
def test_decode_resize_batch_on_cuda_matches_cpu(decoder_name: str) -> None:
    images = mixed_batch()
    cuda = decode_resize_batch(images, SIZE, "cuda")
    cpu = decode_resize_batch(images, SIZE, "cpu")
    assert cuda.device.type == "cuda" and cuda.shape == cpu.shape
    for i in range(len(images)):
        assert psnr(cuda[i].cpu().numpy(), cpu[i].numpy(), peak=255) >= MIN_PSNR_DB
    bad = [*images[:2], EncodedImage(CORRUPT_JPEG, "bad-3")]
    with pytest.raises(DecodeError, match="sample bad-3"):
        decode_resize_batch(bad, SIZE, "cuda")
    pixels, failed = decode_resize_batch_skipping_bad(bad, SIZE, "cuda")
    assert [(i, sample_id) for i, sample_id, _ in failed] == [(2, "bad-3")]
    assert pixels.device.type == "cuda" and pixels.shape == (2, 3, SIZE, SIZE)
    for i in range(2):
        assert psnr(pixels[i].cpu().numpy(), cpu[i].numpy(), peak=255) >= MIN_PSNR_DB
