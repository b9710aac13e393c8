"""``--train_sampling_strategy group_by_length`` for NaFlex models: batches of images with similar patch counts.

A NaFlex batch is padded to its longest image (``vlfit.data.naflex.collate_patches``), so a batch that mixes a
64-patch image with 256-patch ones computes on 192 padded patches for it. Grouping by length, as transformers'
``LengthGroupedSampler`` does for token counts, shuffles the records, cuts the order into windows of a quarter of
the set, at most 50 batches (a set of under 8 batches is not grouped), and sorts each window by length: each batch
then holds images of nearly one patch count, and the order of the windows stays random.

The lengths are each image's patch count under the run's budget, read from the image headers (no decode) once
before training: the grid ``Siglip2ImageProcessor`` chooses, as the loader cuts it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from vlfit.data.decode import DecodeError
from vlfit.data.epoch_sampler import EpochSeededSampler
from vlfit.data.naflex import NaflexTransform

if TYPE_CHECKING:
    from vlfit.data.sources.base import ImageTextSource

logger = logging.getLogger(__name__)


def patch_counts(source: ImageTextSource, patch_size: int, max_num_patches: int) -> list[int]:
    """Each record's patch count under ``max_num_patches``, from its image's header.

    A record whose image cannot be read counts as the budget: the loader then skips and counts it, or stops on it,
    as ``--bad_sample_policy`` says (nothing is decided here).
    """
    transform = NaflexTransform(patch_size, max_num_patches)
    counts: list[int] = []
    unreadable = 0
    for record in source:
        try:
            counts.append(transform.num_patches(record.image, record.id))
        except DecodeError:
            counts.append(max_num_patches)
            unreadable += 1
    if unreadable:
        logger.warning("%d of %d images have no readable header; they count as %d patches when grouping by length",
                       unreadable, len(counts), max_num_patches)  # fmt: skip
    return counts


def length_grouped_order(lengths: Sequence[int], batch_size: int, generator: torch.Generator) -> list[int]:
    """A random order of ``range(len(lengths))`` whose windows of (at most) 50 batches are each sorted longest
    first, the window holding the longest record first (an out-of-memory shows at the first step): transformers'
    ``get_length_grouped_indices``, called so both group alike."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    return [int(i) for i in get_length_grouped_indices(list(lengths), batch_size, generator=generator)]


class PatchCountGroupedSampler(EpochSeededSampler):
    """Every record once per epoch, in batches of similar patch counts (``length_grouped_order``).

    The order depends only on ``seed`` and the epoch (``EpochSeededSampler``).

    Args:
        lengths: Each record's patch count (``patch_counts``).
        batch_size: The loader's batch size (per process).
        seed: The run's seed.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        super().__init__(seed)
        self.lengths = list(lengths)
        self.batch_size = batch_size
        if len(self.lengths) < 8 * batch_size:
            logger.warning("%d records make fewer than 8 batches of %d: grouping by length leaves them shuffled",
                           len(self.lengths), batch_size)  # fmt: skip

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        if not self.lengths:
            return iter(())
        return iter(length_grouped_order(self.lengths, self.batch_size, self.epoch_generator()))
