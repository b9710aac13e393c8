"""The one image path of a run: ``ImageInputs``, built once from its ``InputSpec``, turns images into the batches
its model takes, at every door.

Its transform is the fast CPU pipeline's (``image_transform``, the one place a spec becomes a transform): square
uint8 pixels (center crop, bicubic resize), or for a NaFlex model (SigLIP 2) the uint8 patches of each image's own
grid at the run's token budget (``vlfit.data.naflex``). A batch (``ImageBatch``) is the encoder's image inputs,
``encoder.encode_images(**batch)`` (``vlfit.inference.backends``) and ``ImageTower(**batch)``:

- ``pixels``: uint8 ``[B, 3, S, S]``, or a NaFlex model's uint8 patches ``[B, N, p * p * 3]`` padded to the
  longest image;
- for a NaFlex model, ``pixel_attention_mask`` int32 ``[B, N]`` and ``spatial_shapes`` int64 ``[B, 2]``.

``ImageInputs.batch`` makes one of images as users hand them to the Python API (``vlfit.Model.encode_images``,
``answer``), the server and the re-ranker: a path, encoded bytes, a PIL image or a uint8 array. Doors that read a
source (the index build, export samples, few-shot, classify) take host batches from the input pipeline, whose
transform is the same ``image_transform``, and ``encoder_inputs`` of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from vlfit.data.image_transforms import FastImageTransform, hwc_to_chw_view, resize_crop_uint8, stack_images
from vlfit.data.naflex import NaflexTransform, PatchImage, collate_patches, concat_patch_batches
from vlfit.errors import DataError, MissingFileError
from vlfit.models.family import InputSpec

# What encode_images takes, each item on its own: a path, encoded bytes, a PIL image or a uint8 HWC (or HW) array.
ImageInput = str | os.PathLike | bytes | Image.Image | np.ndarray
# The encoder's image inputs of a batch (see the module doc).
ImageBatch = dict[str, torch.Tensor]
# A NaFlex batch's inputs beside its patches.
PATCH_KEYS = ("pixel_attention_mask", "spatial_shapes")


def image_transform(spec: InputSpec, *, random_resized_crop: bool = False) -> FastImageTransform | NaflexTransform:
    """The fast CPU pipeline's transform of ``spec``: encoded bytes -> uint8 pixels ``[3, S, S]``, or a NaFlex
    model's ``PatchImage`` at its token budget.

    Args:
        spec: The run's input spec.
        random_resized_crop: Training's random resized crop (square images only; NaFlex refuses it earlier).
    """
    if spec.max_num_patches is not None:
        return NaflexTransform(int(spec.patch_size), spec.max_num_patches)  # type: ignore[arg-type]
    return FastImageTransform(spec.image_size, random_resized_crop=random_resized_crop)


class ImageInputs:
    """Images -> the batches a model takes (see the module doc), built once from its input spec.

    Args:
        spec: The run's input spec.
    """

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self.transform = image_transform(spec)

    @property
    def naflex(self) -> bool:
        """Images are NaFlex patches with their mask and grids, not square pixels."""
        return self.spec.max_num_patches is not None

    def __call__(self, data: bytes, sample_id: str = "?") -> torch.Tensor | PatchImage:
        """One encoded image: uint8 pixels ``[3, S, S]`` or NaFlex patches.

        Raises:
            DataError: naming ``sample_id``, for bytes that are no image the pipeline decodes.
        """
        return self.transform(data, sample_id=sample_id)

    def image(self, item: ImageInput, position: int = 0) -> torch.Tensor | PatchImage:
        """One image as users hand it (see ``ImageInput``); ``position`` numbers it in error messages.

        Raises:
            MissingFileError: for a path that is no file.
            DataError: naming ``images[position]``, for bytes that are no image or an array of another dtype or
                shape.
        """
        item = _bytes_or_array(item, position)
        if isinstance(item, bytes):
            return self(item, sample_id=f"images[{position}]")  # DataError names it
        if isinstance(self.transform, NaflexTransform):
            return self.transform.from_pixels(item)
        return resize_crop_uint8(hwc_to_chw_view(item), self.spec.image_size)

    def batch(self, images: ImageInput | Iterable[ImageInput], start: int = 0) -> ImageBatch:
        """The batch of ``images`` (one, a list, or a uint8 ``[N, H, W, C]`` array), in one copy; ``start`` numbers
        them in error messages."""
        return collate_images([self.image(item, start + i) for i, item in enumerate(image_list(images))])


def collate_images(images: Sequence[torch.Tensor | PatchImage]) -> ImageBatch:
    """The batch of images ``ImageInputs`` made: pixels stacked, or NaFlex patches padded to the longest with their
    mask and grids."""
    if isinstance(images[0], PatchImage):
        return encoder_inputs(collate_patches(images))  # type: ignore[arg-type]
    return {"pixels": stack_images(images)}  # type: ignore[arg-type]


def encoder_inputs(inputs: Mapping[str, torch.Tensor]) -> ImageBatch:
    """The ``ImageBatch`` of a host batch's ``inputs`` (``pixel_values`` and, for NaFlex, its mask and grids)."""
    return {"pixels": inputs["pixel_values"], **{name: inputs[name] for name in PATCH_KEYS if name in inputs}}


def split_images(batch: ImageBatch) -> list[torch.Tensor | PatchImage]:
    """Each image of a batch on its own (views of it): pixels ``[3, S, S]``, or NaFlex patches without padding."""
    if "spatial_shapes" not in batch:
        return list(batch["pixels"])
    shapes = batch["spatial_shapes"].tolist()
    return [PatchImage(patches[: rows * columns], rows, columns)
            for patches, (rows, columns) in zip(batch["pixels"], shapes, strict=True)]  # fmt: skip


def select_images(batch: ImageBatch, rows: slice | Sequence[int] | torch.Tensor) -> ImageBatch:
    """The images ``rows`` of a batch; NaFlex patches and mask cut to the longest of them."""
    chosen = {name: tensor[rows] for name, tensor in batch.items()}
    if "spatial_shapes" in chosen:
        longest = int(chosen["spatial_shapes"].prod(-1).max())
        chosen["pixels"], chosen["pixel_attention_mask"] = (
            chosen["pixels"][:, :longest], chosen["pixel_attention_mask"][:, :longest]
        )  # fmt: skip
    return chosen


def concat_image_batches(batches: Sequence[ImageBatch]) -> ImageBatch:
    """Batches as one: pixels concatenated; NaFlex patches and masks padded to the longest first."""
    if "pixel_attention_mask" not in batches[0]:
        return {"pixels": torch.cat([batch["pixels"] for batch in batches])}
    joined = concat_patch_batches([{**batch, "pixel_values": batch["pixels"]} for batch in batches])
    return {"pixels": joined.pop("pixel_values"), **joined}


def image_list(images: ImageInput | Iterable[ImageInput]) -> list[ImageInput]:
    """One image, or a batch of them, as a list: a ``[N, H, W, C]`` uint8 array is N images."""
    if isinstance(images, np.ndarray):
        return list(images) if images.ndim == 4 else [images]
    if isinstance(images, torch.Tensor):
        raise DataError("images: pass a numpy uint8 array [N, H, W, C] or a list of images, not a torch tensor")
    if isinstance(images, (str, os.PathLike, bytes, Image.Image)):
        return [images]
    return list(images)


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


__all__ = [
    "ImageBatch",
    "ImageInput",
    "ImageInputs",
    "collate_images",
    "concat_image_batches",
    "encoder_inputs",
    "image_list",
    "image_transform",
    "select_images",
    "split_images",
]
