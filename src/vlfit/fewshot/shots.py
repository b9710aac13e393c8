"""The few labelled images: for each seed, a seeded order of every class's rows; ``k`` shots are the first ``k``
usable rows of each order.

So every method sees the same images for one shot count and seed, and the shots of a smaller count are among those
of a larger one (the curves over shot counts differ by the added images only). An unusable image (it does not
decode) is listed and passed over for the next row of its class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlfit.data.batch import BadSample
from vlfit.data.image_inputs import ImageBatch
from vlfit.data.sources.labelled import LabelledSplit
from vlfit.errors import DataError
from vlfit.fewshot.images import DecodedRows, decode_rows
from vlfit.models.family import InputSpec


@dataclass
class Shots:
    """Attributes:
    rows: The chosen rows of the training split, class by class.
    labels: Their class indices.
    images: Their batch (``vlfit.data.image_inputs``): uint8 pixels ``[len(rows), 3, H, W]``, or NaFlex patches
        with their mask and grids.
    """

    rows: np.ndarray
    labels: np.ndarray
    images: ImageBatch


def check_shot_counts(split: LabelledSplit, shot_counts: Sequence[int]) -> None:
    """Raises ``ValueError`` naming the class when a shot count exceeds the images of a class, or is below 1."""
    if not shot_counts or min(shot_counts) < 1:
        raise DataError(f"--shots must be positive counts of images per class, got {list(shot_counts)}")
    counts = split.class_counts()
    smallest = int(np.argmin(counts))
    if max(shot_counts) > counts[smallest]:
        raise DataError(
            f"--shots {max(shot_counts)}: class {split.class_names[smallest]!r} has only {counts[smallest]} images "
            f"in {split.source.name}; lower --shots to at most {counts[smallest]} or add images of it"
        )


class ShotSampler:
    """Draws the shots of a training split, decoding each image once.

    Args:
        split: The training split.
        spec: The model's image size and normalization (the pipeline's resize and crop).
        batch_size: Images decoded per batch.
        num_workers: Loader worker processes.
    """

    def __init__(self, split: LabelledSplit, spec: InputSpec, *, batch_size: int = 32, num_workers: int = 0) -> None:
        self.split = split
        self.spec = spec
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.decoded = DecodedRows({}, {})
        self._image_keys: dict[int, int] = {}

    @property
    def bad_samples(self) -> list[BadSample]:
        return list(self.decoded.bad.values())

    def order(self, class_index: int, seed: int) -> np.ndarray:
        """The rows of a class in the order shots are taken from, for ``seed``."""
        rows = np.flatnonzero(self.split.labels == class_index)
        return np.random.default_rng([seed, class_index]).permutation(rows)

    def draw(self, shots: int, seed: int) -> Shots:
        """``shots`` usable images of every class, each a different image: rows that show an image already drawn
        (``Record.image_key``: another caption of it, or its bytes repeated) are passed over.

        Raises:
            ValueError: when a class has fewer usable images than ``shots``.
        """
        chosen: list[np.ndarray] = []
        drawn_images: set[int] = set()
        for class_index, name in enumerate(self.split.class_names):
            order = self.order(class_index, seed)
            usable: list[int] = []
            start = 0
            while len(usable) < shots and start < len(order):
                wanted = shots - len(usable)
                candidates = order[start : start + wanted]
                start += wanted
                self._decode([row for row in candidates if not self._seen(row)])
                for row in candidates:
                    if row in self.decoded.images and self._image_key(int(row)) not in drawn_images:
                        drawn_images.add(self._image_key(int(row)))
                        usable.append(int(row))
            if len(usable) < shots:
                bad = sum(1 for row in order if row in self.decoded.bad)
                raise DataError(
                    f"--shots {shots}: class {name!r} has {len(usable)} usable images in {self.split.source.name} "
                    f"({bad} do not decode); lower --shots"
                )
            chosen.append(np.array(usable, dtype=np.int64))
        rows = np.concatenate(chosen)
        return Shots(rows=rows, labels=self.split.labels[rows], images=self.decoded.stacked(rows))

    def _image_key(self, row: int) -> int:
        if row not in self._image_keys:
            self._image_keys[row] = self.split.source[row].image_key
        return self._image_keys[row]

    def _seen(self, row: int) -> bool:
        return row in self.decoded.images or row in self.decoded.bad

    def _decode(self, rows: Sequence[int]) -> None:
        if rows:
            new = decode_rows(
                self.split.source, rows, self.spec, batch_size=self.batch_size, num_workers=self.num_workers
            )
            self.decoded.images.update(new.images)
            self.decoded.bad.update(new.bad)
