"""How a training epoch walks a set with several captions per image (``--caption_sampling``).

``every`` (the default): each record is a sample, so an epoch shows every caption once and an image as often as it
has captions. ``one_per_image``: an epoch shows every image once, with one of its captions drawn anew each epoch
(``OneCaptionPerImageSampler``); an epoch is then as long as the number of images.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from vlfit.data.epoch_sampler import EpochSeededSampler


class OneCaptionPerImageSampler(EpochSeededSampler):
    """Each epoch, every image once in a shuffled order, each as one of its records drawn at random.

    The order and the draws depend only on ``seed`` and the epoch (``set_epoch``, which the Trainer's loader calls
    at the start of every epoch), so a resumed run reads the batches the uninterrupted one read.

    Args:
        groups: The record indices of each image (``vlfit.data.image_groups.image_groups``).
        seed: The run's seed.
    """

    def __init__(self, groups: list[np.ndarray], seed: int) -> None:
        if not groups or any(len(group) == 0 for group in groups):
            raise ValueError("every image needs at least one record")
        super().__init__(seed)
        self.groups = groups

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[int]:
        generator = self.epoch_generator()
        order = torch.randperm(len(self.groups), generator=generator).tolist()
        draws = torch.randint(0, 1 << 62, (len(self.groups),), generator=generator).tolist()
        for image in order:
            group = self.groups[image]
            yield int(group[draws[image] % len(group)])
