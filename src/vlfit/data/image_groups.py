"""Which records show the same image, from their image keys (``vlfit.data.records.image_key``): the unique images
in the order they first appear. Evaluation scores over them; ``--caption_sampling one_per_image`` walks them; an
index embeds each once, with all its captions (``image_items``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vlfit.data.sources.base import ImageTextSource


def group_images(image_keys: torch.Tensor | None, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unique images among ``num_rows`` rows, in the order they first appear.

    Args:
        image_keys: ``[rows]`` int64, which image each row shows; ``None``: each row its own image.
        num_rows: The rows.

    Returns:
        The row where each unique image first appears ``[images]`` (its embedding is the image's), and each
        row's image ``[rows]`` as an index into those.
    """
    if image_keys is None or num_rows == 0:
        rows = torch.arange(num_rows)
        return rows, rows
    _, inverse = torch.unique(image_keys, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), num_rows, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(num_rows), reduce="amin")
    order = first.argsort()  # unique images by first appearance
    image_index = torch.empty_like(order)
    image_index[order] = torch.arange(len(order))
    return first[order], image_index[inverse]


def image_groups(image_keys: np.ndarray) -> list[np.ndarray]:
    """The record indices of each image (``group_images``' order), e.g. of ``ImageTextSource.image_keys``."""
    keys = torch.from_numpy(np.asarray(image_keys, dtype=np.int64))
    _, image_of_record = group_images(keys, len(keys))
    image_of_record = image_of_record.numpy()
    by_image = np.argsort(image_of_record, kind="stable")
    return np.split(by_image, np.cumsum(np.bincount(image_of_record))[:-1])


@dataclass(frozen=True)
class ImageItems:
    """The unique images of a source (``image_groups``' order), each one item with every caption it has: what an
    index embeds (one embedding per image) and what its results show.

    Attributes:
        rows: Each image's first record, in the source (its bytes are the image's).
        record_ids: That record's id.
        ids: Each image's id: its ``--image_id_column`` value when it has one, else its first record's id.
        captions: Each image's captions, in record order (``None``: the source has no captions, an image folder).
    """

    rows: list[int]
    record_ids: list[str]
    ids: list[str]
    captions: list[list[str]] | None

    def __len__(self) -> int:
        return len(self.rows)


def image_items(source: ImageTextSource) -> ImageItems:
    """The unique images of ``source`` as ``ImageItems``: records with equal ``Record.image_key`` (one
    ``--image_id_column`` value, one row of a list caption column, or identical bytes) are one image, as
    evaluation scores them. Reads the bytes (not decoding them) of the records without an image id, once; ids
    and captions come from ``ImageTextSource.ids``, ``image_ids`` and ``captions`` (none for a source not
    ``captioned``)."""
    if not len(source):
        return ImageItems([], [], [], [] if source.captioned else None)
    groups = image_groups(source.image_keys())
    rows = [int(group[0]) for group in groups]
    record_ids, image_ids = source.ids(), source.image_ids()
    captions = source.captions() if source.captioned else None
    return ImageItems(
        rows=rows,
        record_ids=[record_ids[row] for row in rows],
        ids=[record_ids[row] if image_ids[row] is None else image_ids[row] for row in rows],  # type: ignore[misc]
        captions=None
        if captions is None
        else [[captions[int(row)] for row in group if captions[int(row)] is not None] for group in groups],
    )
