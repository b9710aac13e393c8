"""Tests for vlfit.data.decode: DCT-scaled JPEG decode, EXIF orientation, other formats, errors and the bomb guard."""

from __future__ import annotations

import io
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from tests.data.image_factory import (
    cmyk_jpeg_bytes,
    exif_jpeg_bytes,
    gif_bytes,
    grayscale_jpeg_bytes,
    jpeg_bytes,
    jpeg_with_declared_size,
    png_16bit_bytes,
    png_palette_bytes,
    png_rgb_bytes,
    png_rgba_bytes,
    progressive_jpeg_bytes,
    textured_array,
    webp_bytes,
)
from vlfit.data import decode
from vlfit.data.decode import (
    DecodeError,
    apply_orientation,
    decode_pil,
    decode_reduced,
    decode_scaled,
    jpeg_exif_orientation,
)


def libjpeg_turbo_scaled_shape(width: int, height: int, target: int) -> tuple[int, int]:
    """(height, width) libjpeg-turbo gives at the smallest k/8 scale keeping both sides >= target (1/1 if none)."""
    for k in range(1, 9):
        h, w = math.ceil(height * k / 8), math.ceil(width * k / 8)
        if h >= target and w >= target:
            return h, w
    return height, width


def pil_draft_shape(width: int, height: int, target: int) -> tuple[int, int]:
    """(height, width) Pillow's JPEG draft mode gives (scales 1, 1/2, 1/4, 1/8 only)."""
    scale = min(width // target, height // target)
    factor = next(a for a in (8, 4, 2, 1) if scale >= a or a == 1)
    return -(-height // factor), -(-width // factor)


def pil_reference(data: bytes, draft: int | None = None) -> np.ndarray:
    """What Pillow alone produces: optional draft, then ``exif_transpose`` and RGB."""
    image = Image.open(io.BytesIO(data))
    if draft is not None:
        image.draft("RGB", (draft, draft))
    return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


# ---------------------------------------------------------------------------------------------- DCT scaling


@pytest.mark.parametrize(
    ("width", "height", "target", "expected"),
    [
        (1024, 768, 294, (384, 512)),  # 3/8 would give 288 < 294
        (1024, 768, 96, (96, 128)),  # 1/8 exactly reaches the target
        (1024, 768, 200, (288, 384)),  # 3/8: libjpeg-turbo scales in eighths, not only powers of two
        (768, 1024, 294, (512, 384)),
        (1024, 768, 768, (768, 1024)),
        (1024, 768, 1000, (768, 1024)),  # target above the short side: full size
        (1001, 777, 100, (195, 251)),  # odd sizes round up
        (50, 40, 32, (35, 44)),
    ],
)
def test_dct_scaling_picks_smallest_scale_above_target(
    width: int, height: int, target: int, expected: tuple[int, int]
) -> None:
    pixels = decode_scaled(jpeg_bytes(width, height, subsampling=2), target)
    assert pixels.shape == (*expected, 3)
    assert pixels.shape[:2] == libjpeg_turbo_scaled_shape(width, height, target)
    assert pixels.dtype == np.uint8


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(8, 400),
    height=st.integers(8, 400),
    target=st.integers(1, 450),
    subsampling=st.sampled_from([0, 1, 2]),
)
def test_dct_scaling_never_goes_below_target(width: int, height: int, target: int, subsampling: int) -> None:
    pixels = decode_scaled(jpeg_bytes(width, height, quality=80, subsampling=subsampling), target)
    h, w = pixels.shape[:2]
    assert (h, w) == libjpeg_turbo_scaled_shape(width, height, target)
    assert h >= min(target, height) and w >= min(target, width)
    if target > min(width, height):
        assert (h, w) == (height, width)


@pytest.mark.parametrize(("width", "height", "target"), [(100, 50, 294), (64, 64, 64), (10, 300, 20)])
def test_small_images_decode_at_full_size(width: int, height: int, target: int) -> None:
    pixels = decode_scaled(jpeg_bytes(width, height), target)
    assert pixels.shape == (height, width, 3)


def test_scaled_decode_matches_pillow_draft_at_same_scale() -> None:
    data = jpeg_bytes(320, 240, subsampling=2)
    for target in (30, 60, 120, 240):  # 1/8, 1/4, 1/2, 1/1: scales both decoders offer
        ours = decode_scaled(data, target)
        theirs = pil_reference(data, draft=target)
        assert ours.shape == theirs.shape
        assert np.abs(ours.astype(int) - theirs).max() <= 2


def test_decoded_content_is_the_encoded_image() -> None:
    original = textured_array(96, 64)
    pixels = decode_scaled(png_rgb_bytes(96, 64), 8)
    np.testing.assert_array_equal(pixels, original)
    pixels = decode_scaled(jpeg_bytes(96, 64, quality=98), 1000)
    assert np.abs(pixels.astype(int) - original).mean() < 2.0


# ---------------------------------------------------------------------------------------------- EXIF orientation


def _jpeg_with_raw_exif(tiff: bytes, width: int = 24, height: int = 16) -> bytes:
    """Insert an APP1 Exif segment holding ``tiff`` right after SOI."""
    base = jpeg_bytes(width, height)
    payload = b"Exif\x00\x00" + tiff
    return base[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + base[2:]


def _big_endian_tiff(orientation: int) -> bytes:
    entries = [
        struct.pack(">HHI4s", 0x010F, 2, 4, b"ab\x00\x00"),  # Make (ASCII), before Orientation
        struct.pack(">HHIH2x", 0x0112, 3, 1, orientation),
    ]
    return b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", len(entries)) + b"".join(entries) + b"\0" * 4


def test_exif_orientation_absent_is_one() -> None:
    assert jpeg_exif_orientation(jpeg_bytes(32, 24)) == 1
    assert jpeg_exif_orientation(progressive_jpeg_bytes(32, 24)) == 1
    assert jpeg_exif_orientation(png_rgb_bytes(8, 8)) == 1
    assert jpeg_exif_orientation(b"") == 1
    assert jpeg_exif_orientation(b"\xff\xd8") == 1


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_read(orientation: int) -> None:
    assert jpeg_exif_orientation(exif_jpeg_bytes(32, 24, orientation)) == orientation
    assert jpeg_exif_orientation(_jpeg_with_raw_exif(_big_endian_tiff(orientation))) == orientation


def test_exif_orientation_out_of_range_or_malformed_is_one() -> None:
    assert jpeg_exif_orientation(_jpeg_with_raw_exif(_big_endian_tiff(9))) == 1
    assert jpeg_exif_orientation(_jpeg_with_raw_exif(_big_endian_tiff(0))) == 1
    assert jpeg_exif_orientation(_jpeg_with_raw_exif(b"XX\x00\x2a")) == 1
    assert jpeg_exif_orientation(_jpeg_with_raw_exif(b"MM\x00\x2a\x00\x00\xff\xff")) == 1  # IFD offset past the end


@pytest.mark.parametrize("orientation", range(1, 9))
def test_apply_orientation_matches_pillow_transpose(orientation: int) -> None:
    array = np.random.default_rng(orientation).integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(array)
    image.getexif()[0x0112] = orientation
    expected = np.asarray(ImageOps.exif_transpose(image))
    np.testing.assert_array_equal(apply_orientation(array, orientation), expected)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow_full_scale(orientation: int) -> None:
    data = exif_jpeg_bytes(40, 30, orientation)
    ours = decode_scaled(data, 1000)  # target above both sides: no DCT scaling
    theirs = pil_reference(data)
    assert ours.shape == theirs.shape == ((30, 40, 3) if orientation <= 4 else (40, 30, 3))
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow_half_scale(orientation: int) -> None:
    data = exif_jpeg_bytes(40, 32, orientation)
    ours = decode_scaled(data, 16)  # 1/2 scale: a scale Pillow's draft mode also offers
    theirs = pil_reference(data, draft=16)
    assert ours.shape == theirs.shape == ((16, 20, 3) if orientation <= 4 else (20, 16, 3))
    assert np.abs(ours.astype(int) - theirs).max() <= 2


# ---------------------------------------------------------------------------------------------- other encodings


@pytest.mark.parametrize(
    "make",
    [grayscale_jpeg_bytes, cmyk_jpeg_bytes, png_rgba_bytes, png_palette_bytes, png_16bit_bytes, webp_bytes, gif_bytes],
)
def test_other_encodings_come_out_rgb_hwc_uint8(make) -> None:
    data = make(50, 40)
    pixels = decode_scaled(data, 100)
    assert pixels.shape == (40, 50, 3)
    assert pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels, np.asarray(decode_pil(data)))


def test_grayscale_jpeg_has_equal_channels() -> None:
    pixels = decode_scaled(grayscale_jpeg_bytes(64, 48), 16)
    np.testing.assert_array_equal(pixels[..., 0], pixels[..., 1])
    np.testing.assert_array_equal(pixels[..., 0], pixels[..., 2])


def test_cmyk_jpeg_matches_pillow_and_source() -> None:
    data = cmyk_jpeg_bytes(64, 48)
    pixels = decode_scaled(data, 16)  # Pillow's draft mode scales CMYK too
    assert pixels.shape == (*pil_draft_shape(64, 48, 16), 3)
    np.testing.assert_array_equal(pixels, pil_reference(data, draft=16))
    pixels = decode_scaled(data, 1000)
    np.testing.assert_array_equal(pixels, pil_reference(data))
    assert np.abs(pixels.astype(int) - textured_array(64, 48)).mean() < 8.0


def test_png_rgba_drops_alpha_and_keeps_colour() -> None:
    pixels = decode_scaled(png_rgba_bytes(32, 24), 8)
    np.testing.assert_array_equal(pixels, textured_array(32, 24))


def test_png_16bit_keeps_its_grey_levels() -> None:
    pixels = decode_scaled(png_16bit_bytes(32, 24), 8)
    expected = textured_array(32, 24).mean(axis=-1).astype(np.uint8)
    np.testing.assert_array_equal(pixels[..., 0], expected)
    assert pixels.min() < 200  # not clipped to white


# ---------------------------------------------------------------------------------------------- errors


def _truncated_jpeg() -> bytes:
    data = jpeg_bytes(128, 128)
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image at all",
        b"\xff\xd8\xff\xe0" + b"\x00" * 64,
        _truncated_jpeg(),
        jpeg_bytes(64, 64)[:200],
        png_rgb_bytes(32, 32)[:60],
    ],
    ids=["empty", "garbage", "jpeg-magic-garbage", "truncated-scan", "truncated-header", "truncated-png"],
)
def test_corrupt_data_raises_decode_error_naming_sample(data: bytes) -> None:
    with pytest.raises(DecodeError, match="sample-17"):
        decode_scaled(data, 32, sample_id="sample-17")
    with pytest.raises(DecodeError, match="sample-17"):
        decode_pil(data, sample_id="sample-17")


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)


def test_declared_bomb_is_refused_before_decoding() -> None:
    data = jpeg_with_declared_size(60000, 60000)
    with pytest.raises(DecodeError, match=r"sample big.*bomb limit"):
        decode_scaled(data, 64, sample_id="big")
    with pytest.raises(DecodeError, match=r"(?i)sample big.*bomb"):
        decode_pil(data, sample_id="big")


@pytest.mark.parametrize("make", [jpeg_bytes, cmyk_jpeg_bytes, png_rgb_bytes, webp_bytes])
def test_bomb_limit_applies_to_every_path(monkeypatch: pytest.MonkeyPatch, make) -> None:
    monkeypatch.setattr(decode, "MAX_IMAGE_PIXELS", 64 * 64 - 1)
    data = make(64, 64)
    with pytest.raises(DecodeError, match=r"sample b1: image declares 64x64 pixels, over the bomb limit"):
        decode_scaled(data, 16, sample_id="b1")
    with pytest.raises(DecodeError, match=r"over the bomb limit"):
        decode_pil(data, sample_id="b1")
    monkeypatch.setattr(decode, "MAX_IMAGE_PIXELS", 64 * 64)
    assert decode_scaled(data, 16).shape[2] == 3


def test_a_scaled_decode_says_where_the_image_lies_in_its_pixels() -> None:
    """libjpeg rounds a scaled side up: 577 rows at 1/8 are 72.125 rows in 73. EXIF orientation 6 (a quarter turn
    clockwise) makes them columns and puts the partial one first."""
    upright = decode_reduced(jpeg_bytes(770, 577), 64, 64)
    assert upright.pixels.shape == (73, 97, 3) and upright.box == (0, 0, 72.125, 96.25) and upright.reduced
    turned = decode_reduced(exif_jpeg_bytes(770, 577, orientation=6), 64, 64)
    assert turned.pixels.shape == (97, 73, 3) and turned.box == (0, 0.875, 96.25, 72.125)
    flipped = decode_reduced(exif_jpeg_bytes(770, 577, orientation=3), 64, 64)
    assert flipped.box == (0.875, 0.75, 72.125, 96.25)
    whole = decode_reduced(jpeg_bytes(770, 577), 1000, 1000)  # no DCT scaling
    assert whole.box == (0, 0, 577, 770) and not whole.reduced
    assert not decode_reduced(png_rgb_bytes(770, 577), 64, 64).reduced
