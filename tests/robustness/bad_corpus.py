"""A corpus of dirty image-text inputs, generated in memory (no committed blobs).

Images: every encoding real data holds (PNG RGBA/palette/16-bit, WebP, animated GIF, grayscale, CMYK,
progressive and EXIF-rotated JPEG, 1x1 and 4000x20 images), plus data no decoder should accept (truncated JPEG,
random bytes, empty and all-zero data, declared decompression bombs). Captions: empty, whitespace-only, missing,
10,000 characters, and invalid UTF-8.

Each valid image comes with ``expected``: the RGB pixels a correct decoder produces at full size, with EXIF
orientation applied as Pillow's ``ImageOps.exif_transpose`` does. It is computed with Pillow, independently of
vlfit's decoders, except for 16-bit PNG, where vlfit deliberately keeps the high byte (Pillow's RGB conversion
clips every 16-bit value above 255 to white).
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from tests.data.image_factory import (
    cmyk_jpeg_bytes,
    exif_jpeg_bytes,
    grayscale_jpeg_bytes,
    jpeg_bytes,
    jpeg_with_declared_size,
    png_16bit_bytes,
    png_palette_bytes,
    png_rgb_bytes,
    png_rgba_bytes,
    progressive_jpeg_bytes,
    textured_image,
    webp_bytes,
)
from vlfit.data.sources.memory import MemorySource


@dataclass(frozen=True)
class CorpusImage:
    """One encoded image of the corpus.

    Attributes:
        name: Short identifier (also used as the sample id).
        data: The encoded bytes.
        bad_reason: For data no decoder should accept, a regex the ``DecodeError`` reason matches; else ``None``.
        expected: For valid images, the full-size RGB HWC uint8 pixels a correct decoder produces.
    """

    name: str
    data: bytes
    bad_reason: str | None = None
    expected: np.ndarray | None = None

    @property
    def valid(self) -> bool:
        return self.bad_reason is None


@dataclass(frozen=True)
class CorpusCaption:
    """One caption of the corpus.

    Attributes:
        name: Short identifier.
        value: What the source yields (text, bytes, or ``None``).
        bad_reason: For captions that make the sample bad, a regex of the reason; else ``None``.
    """

    name: str
    value: str | bytes | None
    bad_reason: str | None = None


def animated_gif_bytes(width: int, height: int, frames: int = 3) -> bytes:
    """A looping GIF of ``frames`` different frames (decoders take the first)."""
    images = [textured_image(width, height, seed=s).quantize(colors=32) for s in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, "GIF", save_all=True, append_images=images[1:], duration=50, loop=0)
    return buffer.getvalue()


def png_with_declared_size(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width x height`` but which holds almost no data (a decompression bomb header)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    )


def pillow_expected(data: bytes) -> np.ndarray:
    """Pillow's reading of ``data``: first frame, EXIF orientation applied, converted to RGB."""
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


def expected_png(image: CorpusImage) -> bytes:
    """``image.expected`` as a lossless RGB PNG: run it through a pipeline to get what ``image`` should give."""
    assert image.expected is not None, f"{image.name} is not a valid image"
    buffer = io.BytesIO()
    Image.fromarray(image.expected, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def _valid(name: str, data: bytes) -> CorpusImage:
    return CorpusImage(name, data, expected=pillow_expected(data))


def _png_16bit(width: int, height: int) -> CorpusImage:
    data = png_16bit_bytes(width, height)
    high_byte = (np.asarray(Image.open(io.BytesIO(data)), dtype=np.uint16) >> 8).astype(np.uint8)
    return CorpusImage("png_16bit", data, expected=np.repeat(high_byte[:, :, None], 3, axis=2))


def valid_images() -> list[CorpusImage]:
    """Images every pipeline must decode to RGB."""
    return [
        _valid("jpeg_baseline", jpeg_bytes(96, 64, subsampling=2, seed=1)),
        _valid("jpeg_progressive", progressive_jpeg_bytes(80, 64, seed=2)),
        _valid("jpeg_exif_rotated_6", exif_jpeg_bytes(96, 64, 6, seed=3)),
        _valid("jpeg_exif_rotated_8", exif_jpeg_bytes(96, 64, 8, seed=4)),
        _valid("jpeg_grayscale", grayscale_jpeg_bytes(72, 60, seed=5)),
        _valid("jpeg_cmyk", cmyk_jpeg_bytes(72, 60, seed=6)),
        _valid("png_rgba", png_rgba_bytes(70, 50, seed=7)),
        _valid("png_palette", png_palette_bytes(70, 50, seed=8)),
        _png_16bit(64, 48),
        _valid("webp", webp_bytes(80, 60, seed=9)),
        _valid("gif_animated", animated_gif_bytes(60, 48)),
        _valid("jpeg_1x1", jpeg_bytes(1, 1, seed=10)),
        _valid("png_1x1", png_rgb_bytes(1, 1, seed=11)),
        _valid("jpeg_4000x20", jpeg_bytes(4000, 20, seed=12)),
        _valid("png_20x4000", png_rgb_bytes(20, 4000, seed=13)),
    ]


def bad_images() -> list[CorpusImage]:
    """Data no pipeline may accept; each must become a ``DecodeError`` naming the sample."""
    jpeg = jpeg_bytes(128, 96, seed=14)
    rng = np.random.default_rng(15)
    return [
        CorpusImage("jpeg_truncated", jpeg[: len(jpeg) // 2], bad_reason=r"(?i)premature end|truncated"),
        CorpusImage("jpeg_header_only", jpeg[:200], bad_reason=r"(?i)corrupt|premature end|truncated|decode"),
        CorpusImage("random_bytes", rng.bytes(2048), bad_reason=r"not an image format"),
        CorpusImage("zero_bytes", b"", bad_reason=r"image is empty \(0 bytes\)"),
        CorpusImage("all_zero_bytes", b"\x00" * 1024, bad_reason=r"not an image format"),
        CorpusImage("jpeg_bomb", jpeg_with_declared_size(60000, 60000), bad_reason=r"bomb limit"),
        CorpusImage("png_bomb", png_with_declared_size(100000, 100000), bad_reason=r"bomb limit"),
    ]


def captions() -> list[CorpusCaption]:
    """Dirty captions: which make a sample bad, and which are usable text."""
    return [
        CorpusCaption("plain", "a red square above a blue circle"),
        CorpusCaption("empty", "", bad_reason=r"caption is empty"),
        CorpusCaption("whitespace", " \t\n  ", bad_reason=r"caption is whitespace only"),
        CorpusCaption("none", None, bad_reason=r"caption is missing \(None\)"),
        CorpusCaption("long_10000", ("a long caption about a cat " * 400)[:10_000]),
        CorpusCaption("invalid_utf8", b"a caf\xe9 on the corner \xff\xfe of the street"),
    ]


# The records the tests build, as a source.
ListSource = MemorySource
