"""Which records show the same image, from their image keys (``vlfit.data.records.image_key``): the unique images
in the order they first appear. Evaluation scores over them; ``--caption_sampling one_per_image`` walks them."""

from __future__ import annotations

import numpy as np
import torch


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
