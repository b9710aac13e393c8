"""NaFlex in the fast pipeline: each image at its own aspect ratio, as a variable number of uint8 patches.

SigLIP 2's NaFlex checkpoints (``Siglip2Model``) take an image as the patches of a grid chosen for it: the largest
grid of ``patch_size`` pixels that keeps the image's aspect ratio within ``max_num_patches`` patches (the token
budget), then ``pixel_attention_mask`` and ``spatial_shapes`` say which rows of the padded batch are patches and how
they were laid out. ``Siglip2ImageProcessor`` decodes every image at full size, resizes it and cuts it in float.
Here, per image, in a loader worker:

1. the size is read from the header (JPEG SOF, PNG IHDR, any format through Pillow's lazy open), EXIF orientation
   applied to it;
2. the grid is chosen exactly as the processor chooses it (its own ``get_image_size_for_max_num_patches``);
3. the image is decoded at the smallest DCT scale whose sides still cover twice the grid's (``DECODE_MARGIN``):
   libjpeg-turbo's scaled decode, or Pillow's ``draft`` for the JPEGs libjpeg-turbo cannot convert; then resized
   once to the grid (bilinear, antialiased, on uint8: the kernel the processor's resize calls) and cut into uint8
   patches;

the collator pads a batch to its largest patch count (not to the budget), and the device stage normalizes
(``vlfit.data.normalize.normalize_uint8``). A batch's images then cross the worker pipe and the host-to-device copy
as uint8.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlfit.data.decode import (
    MAX_IMAGE_PIXELS,
    SWAPPING_ORIENTATIONS,
    check_image_header,
    decode_reduced,
    is_jpeg,
    jpeg_exif_orientation,
)
from vlfit.data.image_transforms import hwc_to_chw_view, resize_box
from vlfit.data.worker_memory import new_uint8
from vlfit.errors import DataError

PATCH_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
# The DCT-scaled decode covers this many times the grid's sides, so the one resize after it still averages over at
# least two decoded pixels per output pixel. Covering the grid alone (a last resize of 1.0-1.9x after a 1/8 decode)
# put 16-patch images of plain transformers' full decode at cosine 0.997; with 2, every kind of photo the parity
# test makes is at 0.99998 or above, and a 4000 x 3000 JPEG still decodes at 1/8.
DECODE_MARGIN = 2


@lru_cache(maxsize=65536)
def patch_grid(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """The ``(height, width)`` in pixels, multiples of ``patch_size``, that ``Siglip2ImageProcessor`` resizes an image
    of ``height x width`` to under ``max_num_patches``: its own search, called (so the grid is the same whatever
    transformers' version does)."""
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

    return get_image_size_for_max_num_patches(height, width, patch_size, max_num_patches)


@dataclass(frozen=True)
class PatchImage:
    """One image as NaFlex patches.

    Attributes:
        patches: uint8 ``[rows * columns, patch_size * patch_size * 3]``, each patch's pixels row by row, RGB last
            (``Siglip2ImageProcessor``'s order).
        rows: Patches down (``spatial_shapes``' first value).
        columns: Patches across.
    """

    patches: torch.Tensor
    rows: int
    columns: int


def image_header(data: bytes, sample_id: str = "?") -> tuple[int, int, int]:
    """``(height, width, orientation)`` of an encoded image as shown (EXIF orientation applied to the sizes), read
    from its header without decoding.

    Raises:
        DecodeError: naming the sample, for data that is no image or declares too many pixels.
    """
    width, height = check_image_header(data, sample_id)
    if is_jpeg(data):
        orientation = jpeg_exif_orientation(data)
    else:
        try:
            orientation = int(Image.open(io.BytesIO(data)).getexif().get(0x0112, 1))
        except Exception:  # a broken EXIF block: shown unrotated, as ImageOps.exif_transpose leaves it
            orientation = 1
        orientation = orientation if 1 <= orientation <= 8 else 1
    if orientation in SWAPPING_ORIENTATIONS:
        height, width = width, height
    return height, width, orientation


def decode_covering(data: bytes, height: int, width: int, sample_id: str = "?") -> np.ndarray:
    """RGB HWC uint8 pixels of an image, oriented, decoded at the smallest power-of-two DCT scale whose sides still
    cover ``height x width`` (the sizes as shown; ``vlfit.data.decode.decode_reduced``)."""
    return decode_reduced(data, height, width, sample_id, powers_of_two=True).pixels


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """uint8 ``[3, H, W]`` (H and W multiples of ``patch_size``) -> ``[H/p * W/p, p * p * 3]``, in
    ``Siglip2ImageProcessor``'s order (patch rows, patch columns; inside a patch its rows, columns, channels)."""
    _, height, width = image.shape
    rows, columns = height // patch_size, width // patch_size
    hwc = image.permute(1, 2, 0)
    patches = hwc.reshape(rows, patch_size, columns, patch_size, 3).permute(0, 2, 1, 3, 4)
    return patches.reshape(rows * columns, patch_size * patch_size * 3)


def resize_uint8_bilinear(
    image: torch.Tensor, height: int, width: int, box: tuple[float, float, float, float] | None = None
) -> torch.Tensor:
    """uint8 ``[3, H, W]`` resized to ``height x width``, bilinear and antialiased on uint8 (the native kernel
    torchvision's ``resize`` calls on the CPU, so the processor's resize of the same pixels is the same); of
    ``box`` (``ScaledPixels.box``, see ``resize_box``) when given."""
    if box is None and tuple(image.shape[-2:]) == (height, width):
        return image
    batched = image.unsqueeze(0)
    if batched.is_contiguous(memory_format=torch.channels_last):  # pytorch#68430, as image_transforms says
        batched = batched.as_strided(batched.shape, (batched.numel(), *batched.stride()[1:]))
    if box is not None:
        return resize_box(batched, height, width, box, mode="bilinear")[0]
    return torch.nn.functional.interpolate(batched, size=(height, width), mode="bilinear", antialias=True)[0]


class NaflexTransform:
    """bytes -> ``PatchImage``: header, grid, DCT-scaled decode, one uint8 resize, patches (see the module doc).

    Args:
        patch_size: Side of a patch in pixels.
        max_num_patches: The token budget: at most this many patches an image.
    """

    def __init__(self, patch_size: int, max_num_patches: int) -> None:
        self.patch_size = patch_size
        self.max_num_patches = max_num_patches

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The grid's ``(height, width)`` in pixels for an image of ``height x width``."""
        return patch_grid(height, width, self.patch_size, self.max_num_patches)

    def num_patches(self, data: bytes, sample_id: str = "?") -> int:
        """How many patches ``__call__`` cuts the encoded image into, from its header alone (no decode)."""
        grid_height, grid_width = self.grid(*image_header(data, sample_id)[:2])
        return (grid_height // self.patch_size) * (grid_width // self.patch_size)

    def __call__(self, data: bytes, sample_id: str = "?") -> PatchImage:
        height, width, _ = image_header(data, sample_id)
        grid = self.grid(height, width)
        cover = (math.ceil(side * DECODE_MARGIN) for side in grid)
        decoded = decode_reduced(data, *cover, sample_id, powers_of_two=True)
        return self.from_pixels(decoded.pixels, grid, decoded.box if decoded.reduced else None)

    def from_pixels(
        self,
        pixels: np.ndarray,
        grid: tuple[int, int] | None = None,
        box: tuple[float, float, float, float] | None = None,
    ) -> PatchImage:
        """The patches of RGB HWC uint8 pixels, resized to ``grid`` (``(height, width)`` in pixels; default the grid
        of the pixels' own size). A DCT-scaled decode passes the grid of the full size (the scaled sides are rounded
        up, so their own grid could differ) and its ``box``."""
        grid_height, grid_width = grid or self.grid(*pixels.shape[:2])
        resized = resize_uint8_bilinear(hwc_to_chw_view(pixels), grid_height, grid_width, box)
        patch = self.patch_size
        return PatchImage(patchify(resized, patch).contiguous(), grid_height // patch, grid_width // patch)


def check_naflex_options(options: Any) -> None:
    """Refuse, in one line naming the flag, a pipeline option NaFlex images do not take.

    Raises:
        DataError: for ``--image_pipeline reference``, ``--random_resized_crop`` or ``--horizontal_flip``.
    """
    refused = {
        "--image_pipeline reference": options.image_pipeline != "fast",
        "--random_resized_crop": options.random_resized_crop,
        "--horizontal_flip": options.horizontal_flip,
    }
    for flag, given in refused.items():
        if given:
            raise DataError(
                f"{flag}: a NaFlex model (SigLIP 2) takes each image whole at its own aspect ratio, through the fast "
                "pipeline; leave the flag out"
            )


def collate_patches(
    images: Sequence[PatchImage], *, shared: bool = False, multiple_of: int = 1
) -> dict[str, torch.Tensor]:
    """The NaFlex inputs of a batch: uint8 ``pixel_values`` ``[B, N, p * p * 3]`` padded with zeros to the batch's
    largest patch count ``N`` (rounded up to ``multiple_of``), ``pixel_attention_mask`` int32 ``[B, N]`` (1 for a
    patch, 0 for padding) and ``spatial_shapes`` int64 ``[B, 2]`` (patch rows and columns).

    Args:
        images: The batch's images.
        shared: A loader worker's batch: its pixels in shared memory where they cross to the main process through it
            (``vlfit.data.worker_memory``).
        multiple_of: Round the padded length up to a multiple of this.
    """
    longest = max(len(image.patches) for image in images)
    longest = math.ceil(longest / multiple_of) * multiple_of
    width = images[0].patches.shape[1]
    count = len(images)
    pixels = new_uint8((count, longest, width), shared=shared)
    mask = torch.zeros((count, longest), dtype=torch.int32)
    shapes = torch.empty((count, 2), dtype=torch.long)
    for row, image in enumerate(images):
        used = len(image.patches)
        pixels[row, :used] = image.patches
        pixels[row, used:] = 0
        mask[row, :used] = 1
        shapes[row, 0], shapes[row, 1] = image.rows, image.columns
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def concat_patch_batches(batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """NaFlex batches (``collate_patches``' keys) as one: pixels and masks padded with zeros to the longest first."""
    longest = max(batch["pixel_values"].shape[1] for batch in batches)

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, [0, 0] * (tensor.dim() - 2) + [0, longest - tensor.shape[1]])

    return {"pixel_values": torch.cat([padded(batch["pixel_values"]) for batch in batches]),
            "pixel_attention_mask": torch.cat([padded(batch["pixel_attention_mask"]) for batch in batches]),
            "spatial_shapes": torch.cat([batch["spatial_shapes"] for batch in batches])}  # fmt: skip


def padding_waste(shapes: torch.Tensor, padded_length: int) -> tuple[int, int]:
    """``(padded, total)`` patch rows of a batch: padding rows and all rows."""
    used = int(shapes.prod(-1).sum())
    total = int(shapes.shape[0]) * padded_length
    return total - used, total


__all__ = [
    "MAX_IMAGE_PIXELS",
    "check_naflex_options",
    "PATCH_INPUTS",
    "NaflexTransform",
    "PatchImage",
    "collate_patches",
    "concat_patch_batches",
    "decode_covering",
    "image_header",
    "patch_grid",
    "patchify",
]
