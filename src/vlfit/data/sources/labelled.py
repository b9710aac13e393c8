"""Labelled splits: a dataset split whose rows carry a class (the image source, each row's class index, the class
names), what ``vlfit fewshot`` draws shots from; and the zero-shot sets classified while fine-tuning
(``--zeroshot_dataset``): a labelled split with the prompts its classes are written into. Both are opened by
``vlfit.data.sources.openers`` (``labelled_splits``, ``open_zeroshot_sets``)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlfit.data.records import BadRecordError, image_key
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import ConfigError, DataError

DEFAULT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.",
    "a drawing of a {}.",
    "a picture of a {}.",
    "an image of a {}.",
    "a {}.",
)


@dataclass
class LabelledSplit:
    """Attributes:
    source: The split's images (its captions are the class names).
    labels: Each row's class index into ``class_names``, ``int64 [N]``.
    class_names: The classes, in label order.
    label_column: The column the classes come from.
    rows_per_image: For a split of one row per image (``per_image``), how many rows of the data each image
        had; None: one each.
    """

    source: ImageTextSource
    labels: np.ndarray
    class_names: list[str]
    label_column: str
    rows_per_image: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_rows(self) -> int:
        """The rows of the data this split's images came from."""
        return len(self) if self.rows_per_image is None else int(self.rows_per_image.sum())

    def per_image(self) -> LabelledSplit:
        """The split with one row per image, its first: rows that show one image are grouped as retrieval
        evaluation groups them (``Record.image_key``: one ``--image_id_column`` value, or identical bytes), so an
        image with three rows is one shot and one evaluated image, not three.

        Raises:
            DataError: for an image whose rows disagree on its class.
        """
        # Images in the order they first appear, as vlfit.data.image_groups orders them.
        _, first, image_of_row = np.unique(self._image_keys(), return_index=True, return_inverse=True)
        first_of_row = first[image_of_row.reshape(-1)]
        disagree = np.flatnonzero(self.labels != self.labels[first_of_row])
        if disagree.size:
            row = int(disagree[0])
            head, other = int(first_of_row[row]), self.class_names[self.labels[row]]
            raise DataError(
                f"{self.source.name}: rows {head} and {row} show one image but are labelled "
                f"{self.class_names[self.labels[head]]!r} and {other!r} in {self.label_column!r}: fix their labels, "
                "or name what tells images apart with --image_id_column"
            )
        order = np.argsort(first)
        firsts, counts = first[order].astype(np.int64), np.bincount(image_of_row.reshape(-1))[order]
        return LabelledSplit(self.source.select(firsts), self.labels[firsts], self.class_names, self.label_column,
                             counts.astype(np.int64))  # fmt: skip

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=len(self.class_names))

    def majority_share(self) -> float:
        """The accuracy of always answering the most frequent class: chance."""
        return float(self.class_counts().max() / len(self.labels))

    def _image_keys(self) -> np.ndarray:
        """``ImageTextSource.image_keys``, a row whose image cannot be read being an image of its own (the pipeline
        leaves it out and lists it, as it does an image that does not decode)."""
        keys = []
        for row, image_id in enumerate(self.source.image_ids()):
            try:
                keys.append(image_key(b"", image_id) if image_id is not None else self.source[row].image_key)
            except BadRecordError:
                keys.append(image_key(f"unreadable row {row}".encode()))
        return np.asarray(keys, dtype=np.int64)

    def first(self, count: int) -> LabelledSplit:
        """The split's first ``count`` rows (images, of a split ``per_image``)."""
        rows = np.arange(min(count, len(self)))
        counts = None if self.rows_per_image is None else self.rows_per_image[rows]
        return LabelledSplit(self.source.select(rows), self.labels[rows], self.class_names, self.label_column, counts)


def check_templates(templates: Sequence[str]) -> None:
    """Raises ``ConfigError`` for no template, or a template without exactly one ``{}``."""
    if not templates:
        raise ConfigError("--prompt_template: give at least one template, e.g. 'a photo of a {}.'")
    for template in templates:
        if template.count("{}") != 1:
            raise ConfigError(f"--prompt_template {template!r} must hold '{{}}' once: where the class name goes")


@dataclass(frozen=True)
class ZeroShotSet:
    """A labelled split to classify zero-shot (``vlfit.evaluation.zeroshot`` scores it).

    Attributes:
        name: What its metrics are called: ``zeroshot`` alone, or ``zeroshot_{name}`` among several.
        split: The images, their labels and the class names.
        templates: The prompts, ``{}`` the class name.
    """

    name: str
    split: LabelledSplit
    templates: tuple[str, ...] = DEFAULT_TEMPLATES

    @property
    def prefix(self) -> str:
        return f"zeroshot_{self.name}" if self.name else "zeroshot"


def label_splits(
    train_source: ImageTextSource,
    eval_source: ImageTextSource,
    *,
    train_split: str,
    eval_split: str,
    label_column: str,
    label_flag: str,
) -> tuple[LabelledSplit, LabelledSplit]:
    """Two sources whose captions are class names (the label column read as captions) as labelled splits.

    The classes are those of the training split, in the order of a ``ClassLabel`` column's names (sorted for a
    text column).

    Raises:
        DataError: naming ``label_flag``, when a row has no label, the training split holds fewer than two
            classes, or the evaluation split holds a class the training split lacks.
    """
    train_names = _row_names(train_source, label_column, label_flag)
    eval_names = _row_names(eval_source, label_column, label_flag)
    present = set(train_names)
    declared = getattr(train_source, "class_names", None)
    class_names = [name for name in declared if name in present] if declared else sorted(present)
    if len(class_names) < 2:
        raise DataError(
            f"label column {label_column!r} of split {train_split!r} holds {len(class_names)} class "
            f"({', '.join(map(repr, class_names))}); classification needs at least two: pick another {label_flag}"
        )
    unknown = sorted(set(eval_names) - present)
    if unknown:
        raise DataError(
            f"split {eval_split!r} has classes that split {train_split!r} lacks in label column {label_column!r}: "
            f"{', '.join(map(repr, unknown[:5]))}; no shot of them can be drawn"
        )
    index = {name: i for i, name in enumerate(class_names)}

    def split_of(source: ImageTextSource, names: list[str]) -> LabelledSplit:
        labels = np.array([index[name] for name in names], dtype=np.int64)
        return LabelledSplit(source, labels, class_names, label_column)

    return split_of(train_source, train_names), split_of(eval_source, eval_names)


def _row_names(source: ImageTextSource, label_column: str, label_flag: str) -> list[str]:
    names = source.captions()
    for row, name in enumerate(names):
        if name is None or not str(name).strip():
            raise DataError(
                f"{source.name}: row {row} has no value in label column {label_column!r} ({label_flag}); drop "
                "unlabelled rows first"
            )
    return [str(name) for name in names]


# What the labelled splits' error messages call the options: ``vlfit train``'s flags of the zero-shot sets.
ZEROSHOT_FLAGS = {"label": "--zeroshot_label_column", "train_split": "--zeroshot_split",
                  "eval_split": "--zeroshot_split"}  # fmt: skip


def zeroshot_names(dataset_names: Sequence[str]) -> list[str]:
    """The name of each zero-shot set's metrics: ``""`` for one set, else from each dataset's name.

    Raises:
        ConfigError: when two datasets would give the same metric names.
    """
    names = [_metric_name(dataset) for dataset in dataset_names] if len(dataset_names) > 1 else [""]
    if len(set(names)) != len(names):
        raise ConfigError(f"--zeroshot_dataset: {list(dataset_names)} would share metric names {names}; rename one")
    return names


def _metric_name(dataset: str) -> str:
    return re.sub(r"\W+", "_", os.path.basename(dataset.rstrip("/")) or dataset).strip("_").lower()
