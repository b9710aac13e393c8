"""Decoded images of chosen rows, and embeddings of held images, through the project's fast CPU pipeline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vlfit.data.batch import BadSample
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.models.family import InputSpec


@dataclass
class DecodedRows:
    """Attributes:
    pixels: Row -> uint8 ``[3, H, W]`` of every usable row.
    bad: Row -> why it is unusable.
    """

    pixels: dict[int, torch.Tensor]
    bad: dict[int, BadSample]

    def stacked(self, rows: Sequence[int]) -> torch.Tensor:
        """The pixels of ``rows`` (all usable), ``uint8 [len(rows), 3, H, W]``."""
        return torch.stack([self.pixels[int(row)] for row in rows])


def decode_rows(
    source: ImageTextSource, rows: Sequence[int], spec: InputSpec, *, batch_size: int = 32, num_workers: int = 0
) -> DecodedRows:
    """Decode, resize and crop ``rows`` of ``source`` as evaluation does (no augmentation); bad images are listed,
    not raised."""
    rows = [int(row) for row in rows]
    decoded = DecodedRows({}, {})
    if not rows:
        return decoded
    bad: list[BadSample] = []
    for batch in host_batches(source.select(rows), spec, batch_size=batch_size, num_workers=num_workers):
        bad.extend(batch.bad_samples)
        if len(batch):
            for position, pixels in zip(batch.positions, batch["pixel_values"], strict=True):
                decoded.pixels[rows[position]] = pixels.clone()
    # The pipeline keeps the source's order and lists each batch's bad samples in it: the rows left out, in request
    # order, are the bad samples in order.
    missing = [row for row in rows if row not in decoded.pixels]
    decoded.bad = dict(zip(missing, bad, strict=True))
    return decoded


@torch.no_grad()
def embed_pixels(
    image_tower: Callable[[torch.Tensor], torch.Tensor], pixels: torch.Tensor, batch_size: int = 64
) -> torch.Tensor:
    """Embeddings ``float32 [N, D]`` of uint8 ``pixels [N, 3, H, W]``, ``batch_size`` images per forward."""
    parts = [image_tower(pixels[start : start + batch_size]).float() for start in range(0, len(pixels), batch_size)]
    return torch.cat(parts)
