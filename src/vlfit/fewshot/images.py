"""Decoded images of chosen rows, and embeddings of held images, through the run's one image path: the fast CPU
pipeline's host batches as ``ImageBatch`` values (``vlfit.data.image_inputs``: square pixels, or a NaFlex model's
patches with their mask and grids)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vlfit.data.batch import BadSample
from vlfit.data.image_inputs import ImageBatch, collate_images, encoder_inputs, select_images, split_images
from vlfit.data.naflex import PatchImage
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.models.family import InputSpec


@dataclass
class DecodedRows:
    """Attributes:
    images: Row -> its image, uint8 pixels ``[3, H, W]`` or NaFlex patches, of every usable row.
    bad: Row -> why it is unusable.
    """

    images: dict[int, torch.Tensor | PatchImage]
    bad: dict[int, BadSample]

    def stacked(self, rows: Sequence[int]) -> ImageBatch:
        """The batch of ``rows`` (all usable)."""
        return collate_images([self.images[int(row)] for row in rows])


def decode_rows(
    source: ImageTextSource, rows: Sequence[int], spec: InputSpec, *, batch_size: int = 32, num_workers: int = 0
) -> DecodedRows:
    """Decode, resize and crop (or cut into patches) ``rows`` of ``source`` as evaluation does (no augmentation);
    bad images are listed, not raised."""
    rows = [int(row) for row in rows]
    decoded = DecodedRows({}, {})
    if not rows:
        return decoded
    bad: list[BadSample] = []
    for batch in host_batches(source.select(rows), spec, batch_size=batch_size, num_workers=num_workers):
        bad.extend(batch.bad_samples)
        if len(batch):
            for position, image in zip(batch.positions, split_images(encoder_inputs(batch.inputs)), strict=True):
                decoded.images[rows[position]] = _own_copy(image)
    # The pipeline keeps the source's order and lists each batch's bad samples in it: the rows left out, in request
    # order, are the bad samples in order.
    missing = [row for row in rows if row not in decoded.images]
    decoded.bad = dict(zip(missing, bad, strict=True))
    return decoded


def _own_copy(image: torch.Tensor | PatchImage) -> torch.Tensor | PatchImage:
    """An image of a batch, apart from the batch's (shared) memory."""
    if isinstance(image, PatchImage):
        return PatchImage(image.patches.clone(), image.rows, image.columns)
    return image.clone()


@torch.no_grad()
def embed_images(image_tower: Callable[..., torch.Tensor], images: ImageBatch, batch_size: int = 64) -> torch.Tensor:
    """Embeddings ``float32 [N, D]`` of a batch of ``N`` images, ``batch_size`` images per forward."""
    count = len(images["pixels"])
    parts = [image_tower(**select_images(images, slice(start, start + batch_size))).float()
             for start in range(0, count, batch_size)]  # fmt: skip
    return torch.cat(parts)
