"""Re-encoding one image at training resolution: DCT-scaled decode, shrink to the short side (a NaFlex model's: to
its patch grid), 4:2:0 JPEG.

What ``vlfit prepare`` does to every image (the rest of ``vlfit.data.prepare`` handles the dataset, shards and
resumption).
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass

import numpy as np
import simplejpeg
import torchvision.transforms.v2.functional as F
from PIL import Image
from torchvision.transforms import InterpolationMode

from vlfit.data import naflex
from vlfit.data.decode import decode_scaled, is_jpeg
from vlfit.data.image_transforms import hwc_to_chw_view
from vlfit.data.naflex import NaflexTransform, decode_covering, image_header, resize_uint8_bilinear

DEFAULT_JPEG_QUALITY = 95
CHROMA_SUBSAMPLING = "4:2:0"
# A patch grid's image is the model's pixels themselves, one for one: its chroma is kept whole (4:2:0 halved it,
# and a 16-patch image's embedding fell to cosine 0.998 of plain transformers' on the original photo).
GRID_SUBSAMPLING = "444"
# The encoder ``encode_jpeg`` uses (recorded in the prepare manifest).
JPEG_ENCODER = "simplejpeg"


@dataclass(frozen=True)
class PreparedImage:
    """One re-encoded image and the pixel counts behind it.

    Args:
        data: The JPEG bytes (no EXIF: orientation is already applied to the pixels).
        width: Output width.
        height: Output height.
        source_pixels: Pixels of the stored image at full size.
        decoded_pixels: Pixels actually decoded from the stored image (after DCT scaling).
        small: True when the stored image's short side was already at or below the target: kept at its size.
    """

    data: bytes
    width: int
    height: int
    source_pixels: int
    decoded_pixels: int
    small: bool


def encode_jpeg(pixels: np.ndarray, quality: int = DEFAULT_JPEG_QUALITY, subsampling: str = "420") -> bytes:
    """Encode an RGB HWC uint8 array as a baseline JPEG (4:2:0, or ``subsampling``) without metadata.

    Uses libjpeg-turbo through simplejpeg (accurate DCT).

    Args:
        pixels: RGB HWC uint8 array.
        quality: JPEG quality, 1..100.

    Returns:
        The encoded bytes.
    """
    pixels = np.ascontiguousarray(pixels)
    return simplejpeg.encode_jpeg(
        pixels, quality=quality, colorspace="RGB", colorsubsampling=subsampling, fastdct=False
    )


def _stored_size(data: bytes) -> tuple[int, int]:
    """Full-size (width, height) from the header alone (as stored, before EXIF orientation); (0, 0) if unreadable."""
    if is_jpeg(data):
        with contextlib.suppress(Exception):
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
    with contextlib.suppress(Exception), Image.open(io.BytesIO(data)) as image:
        return image.size
    return 0, 0


def output_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """The (width, height) an image of ``width x height`` is stored at: short side ``short_side``, aspect kept.

    This is the size torchvision's ``Resize([short_side])`` gives the full-size image (the long side truncated, as
    the reference pipeline resizes it), so the aspect ratio is kept to within a pixel. Images whose short side is
    already at or below ``short_side`` keep their size (no upscaling).

    Args:
        width: Image width.
        height: Image height.
        short_side: Target short side in pixels.

    Returns:
        The output (width, height).
    """
    short, long = min(width, height), max(width, height)
    if short <= short_side:
        return width, height
    new_long = int(short_side * long / short)
    return (new_long, short_side) if width >= height else (short_side, new_long)


def prepare_grid_image(
    data: bytes, patch_size: int, max_num_patches: int, *, jpeg_quality: int = DEFAULT_JPEG_QUALITY,
    sample_id: str = "?",
) -> PreparedImage:  # fmt: skip
    """One image stored at the patch grid a NaFlex model cuts it into: decoded and resized as the input pipeline
    does (``vlfit.data.naflex.NaflexTransform``), then re-encoded. The grid of a grid-sized image is that grid, so
    training on the shards decodes it whole and cuts its patches without resizing it again.

    Raises:
        DecodeError: naming ``sample_id`` when the image cannot be decoded.
    """
    transform = NaflexTransform(patch_size, max_num_patches)
    height, width, _ = image_header(data, sample_id)
    grid_height, grid_width = transform.grid(height, width)
    cover = (math.ceil(side * naflex.DECODE_MARGIN) for side in (grid_height, grid_width))
    pixels = decode_covering(data, *cover, sample_id)
    resized = resize_uint8_bilinear(hwc_to_chw_view(pixels), grid_height, grid_width)
    return PreparedImage(
        data=encode_jpeg(resized.permute(1, 2, 0).numpy(), jpeg_quality, GRID_SUBSAMPLING),
        width=grid_width,
        height=grid_height,
        source_pixels=width * height,
        decoded_pixels=pixels.shape[0] * pixels.shape[1],
        small=height * width <= grid_height * grid_width,
    )


def resize_uint8(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """Resize an RGB HWC uint8 array to ``width x height`` (bicubic, antialiased, staying uint8).

    Args:
        pixels: RGB HWC uint8 array.
        width: Output width.
        height: Output height.

    Returns:
        A C-contiguous RGB HWC uint8 array.
    """
    chw = hwc_to_chw_view(pixels)
    out = F.resize(chw.unsqueeze(0), [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)[0]
    return np.ascontiguousarray(out.permute(1, 2, 0).numpy())


def prepare_image(
    data: bytes,
    short_side: int,
    jpeg_quality: int = DEFAULT_JPEG_QUALITY,
    sample_id: str = "?",
    patch_budget: tuple[int, int] | None = None,
) -> PreparedImage:
    """Decode (DCT-scaled, EXIF orientation applied), shrink to ``short_side`` and re-encode one image.

    The output size comes from the stored image's full size (see ``output_size``), not from the DCT-scaled array,
    whose sides libjpeg rounds up (its aspect ratio can be off by more than a pixel at the output size). Images
    whose short side is already at or below ``short_side`` are not upscaled: they are re-encoded at their size.

    Args:
        data: The stored image bytes (any format the decoders read).
        short_side: Short side of the output in pixels.
        jpeg_quality: JPEG quality of the output, 1..100.
        sample_id: Named in decode errors.
        patch_budget: A NaFlex model's ``(patch_size, max_num_patches)``: the image is stored at its patch grid
            instead (``prepare_grid_image``), ``short_side`` unused.

    Returns:
        The re-encoded image and its pixel counts.

    Raises:
        DecodeError: naming ``sample_id`` when the image cannot be decoded.
    """
    if patch_budget is not None:
        return prepare_grid_image(data, *patch_budget, jpeg_quality=jpeg_quality, sample_id=sample_id)
    pixels = decode_scaled(data, short_side, sample_id)
    decoded_height, decoded_width = pixels.shape[:2]
    width, height = _stored_size(data)
    if not width * height:
        width, height = decoded_width, decoded_height
    # The header size is before EXIF orientation: take the ratio from it and the long axis from the decoded array.
    short, long = min(width, height), max(width, height)
    if decoded_width >= decoded_height:
        target = output_size(long, short, short_side)
    else:
        target = output_size(short, long, short_side)
    if short > short_side and target != (decoded_width, decoded_height):
        pixels = resize_uint8(pixels, *target)
    return PreparedImage(
        data=encode_jpeg(pixels, jpeg_quality),
        width=pixels.shape[1],
        height=pixels.shape[0],
        source_pixels=width * height,
        decoded_pixels=decoded_width * decoded_height,
        small=short <= short_side,
    )
