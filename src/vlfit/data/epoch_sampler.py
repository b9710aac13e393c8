"""A training order drawn anew each epoch from the run's seed and the epoch alone (``EpochSeededSampler``): what the
orders of ``--caption_sampling one_per_image`` and ``--train_sampling_strategy group_by_length`` share."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler


class EpochSeededSampler(Sampler[int]):
    """A sampler whose random draws come from ``epoch_generator``: seeded by ``seed`` and the epoch only
    (``set_epoch``, which the Trainer's loader calls at the start of every epoch), so a resumed run reads the batches
    the uninterrupted one read.

    Args:
        seed: The run's seed.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_generator(self) -> torch.Generator:
        """A generator seeded for this epoch of this run."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
