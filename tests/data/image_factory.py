"""In-memory test images: textured content encoded as JPEG (several flavours), PNG, WebP and GIF."""

from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image


def textured_array(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth but non-trivial RGB HWC uint8 image: gradients, low-frequency waves and a few solid shapes.

    The content is band-limited enough that resizing paths can be compared by PSNR, and asymmetric enough that
    flips, rotations and crops change it.
    """
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float64)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float64)[None, :]
    channels = []
    for c in range(3):
        fx, fy, phase = rng.uniform(1.0, 4.0), rng.uniform(1.0, 4.0), rng.uniform(0, 2 * np.pi)
        wave = 0.5 + 0.25 * np.sin(2 * np.pi * (fx * x + fy * y) + phase)
        ramp = 0.25 * (x if c == 0 else y if c == 1 else x * y)
        channels.append(wave + ramp)
    image = np.stack(channels, axis=-1)
    # An off-centre bright block in the top-left quadrant: makes every orientation distinguishable.
    image[: max(1, height // 4), : max(1, width // 3)] = (0.95, 0.2, 0.1)
    return np.clip(image * 255.0, 0, 255).round().astype(np.uint8)


def textured_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """``textured_array`` as a PIL RGB image."""
    return Image.fromarray(textured_array(width, height, seed), "RGB")


def _save(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def jpeg_bytes(
    width: int,
    height: int,
    quality: int = 95,
    subsampling: int = 0,
    seed: int = 0,
    progressive: bool = False,
    orientation: int | None = None,
) -> bytes:
    """A textured RGB JPEG.

    Args:
        subsampling: Pillow's chroma subsampling (0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0).
        orientation: EXIF orientation tag (1..8) to embed; ``None`` writes no EXIF.
    """
    kwargs: dict = {"quality": quality, "subsampling": subsampling, "progressive": progressive}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    return _save(textured_image(width, height, seed), "JPEG", **kwargs)


def progressive_jpeg_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A textured progressive JPEG."""
    return jpeg_bytes(width, height, seed=seed, progressive=True)


def exif_jpeg_bytes(width: int, height: int, orientation: int, seed: int = 0) -> bytes:
    """A textured JPEG with EXIF orientation ``orientation``."""
    return jpeg_bytes(width, height, seed=seed, orientation=orientation)


def grayscale_jpeg_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A single-channel (L) JPEG."""
    return _save(textured_image(width, height, seed).convert("L"), "JPEG", quality=95)


def cmyk_jpeg_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A four-channel CMYK JPEG (Adobe-style)."""
    return _save(textured_image(width, height, seed).convert("CMYK"), "JPEG", quality=95)


def png_rgba_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """An RGBA PNG with a varying alpha channel."""
    rgb = textured_array(width, height, seed)
    alpha = np.linspace(0, 255, width, dtype=np.float64)[None, :].repeat(height, 0).astype(np.uint8)
    return _save(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), "PNG")


def png_rgb_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A lossless RGB PNG."""
    return _save(textured_image(width, height, seed), "PNG")


def png_palette_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A palette-mode (P) PNG."""
    return _save(textured_image(width, height, seed).quantize(colors=64), "PNG")


def png_16bit_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A 16-bit grayscale PNG (mode I;16)."""
    gray = textured_array(width, height, seed).mean(axis=-1).astype(np.uint16) * 257
    return _save(Image.fromarray(gray), "PNG")


def webp_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A lossy WebP."""
    return _save(textured_image(width, height, seed), "WEBP", quality=90)


def gif_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A palette GIF."""
    return _save(textured_image(width, height, seed).quantize(colors=64), "GIF")


def jpeg_with_declared_size(width: int, height: int) -> bytes:
    """A small valid JPEG whose SOF header is patched to declare ``width x height`` (for bomb-guard tests)."""
    data = bytearray(jpeg_bytes(16, 16))
    pos = 2
    while pos + 4 <= len(data):
        marker = data[pos + 1]
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in (0xC0, 0xC1, 0xC2):
            data[pos + 5 : pos + 9] = struct.pack(">HH", height, width)
            return bytes(data)
        pos += 2 + length
    raise AssertionError("no SOF marker found")


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB between two same-shaped arrays (``inf`` when identical)."""
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10.0 * np.log10(peak * peak / mse))
