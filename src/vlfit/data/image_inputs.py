"""Images as users hand them to the Python API (``vlfit.Model.encode_images``, ``answer``): a path, encoded bytes, a
PIL image or a uint8 array, each made into the pixels (or, for a NaFlex model, the patches) the fast CPU pipeline
makes of a file."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image, ImageOps

from vlfit.data.image_transforms import FastImageTransform, hwc_to_chw_view, resize_crop_uint8
from vlfit.data.naflex import NaflexTransform, PatchImage
from vlfit.errors import DataError, MissingFileError

# What encode_images takes, each item on its own: a path, encoded bytes, a PIL image or a uint8 HWC (or HW) array.
ImageInput = str | os.PathLike | bytes | Image.Image | np.ndarray


def pixels_of(item: ImageInput, image_size: int, position: int) -> torch.Tensor:
    """One image as the fast CPU pipeline makes it: uint8 ``[3, S, S]``, center crop, bicubic resize.

    Raises:
        MissingFileError: for a path that is no file.
        DataError: naming ``images[position]``, for bytes that are no image or an array of another dtype or shape.
    """
    item = _bytes_or_array(item, position)
    if isinstance(item, bytes):
        return FastImageTransform(image_size)(item, sample_id=f"images[{position}]")  # DataError names it
    return resize_crop_uint8(hwc_to_chw_view(item), image_size)


def patches_of(item: ImageInput, transform: NaflexTransform, position: int) -> PatchImage:
    """One image as the fast CPU pipeline makes it for a NaFlex model: uint8 patches of its grid.

    Raises:
        MissingFileError: for a path that is no file.
        DataError: naming ``images[position]``, as ``pixels_of``.
    """
    item = _bytes_or_array(item, position)
    if isinstance(item, bytes):
        return transform(item, sample_id=f"images[{position}]")
    return transform.from_pixels(item)


def _bytes_or_array(item: ImageInput, position: int) -> bytes | np.ndarray:
    """A file's bytes, the bytes given, or the RGB HWC uint8 array of a PIL image (EXIF orientation applied) or
    of an array."""
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        if not os.path.isfile(path):
            raise MissingFileError(f"images[{position}] ({path}): no such file")
        with open(path, "rb") as f:
            return f.read()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, Image.Image):
        return np.array(ImageOps.exif_transpose(item).convert("RGB"))
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8:
            raise DataError(f"images[{position}]: a numpy image must be uint8 (HWC or HW), got {item.dtype}")
        array = np.repeat(item[..., None], 3, axis=2) if item.ndim == 2 else item
        if array.ndim != 3 or array.shape[2] not in (3, 4):
            raise DataError(
                f"images[{position}]: a numpy image must be [H, W], [H, W, 3] or [H, W, 4], got {item.shape}"
            )
        return array[..., :3]
    raise DataError(
        f"images[{position}]: expected a path, encoded bytes, a PIL image or a uint8 array, got {type(item).__name__}"
    )


__all__ = ["ImageInput", "patches_of", "pixels_of"]
