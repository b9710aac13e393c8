"""A dataset split whose rows carry a class: the image source, each row's class index, and the class names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlfit.data.source_base import ImageTextSource
from vlfit.errors import DataError


@dataclass
class LabelledSplit:
    """Attributes:
    source: The split's images (its captions are the class names).
    labels: Each row's class index into ``class_names``, ``int64 [N]``.
    class_names: The classes, in label order.
    label_column: The column the classes come from.
    """

    source: ImageTextSource
    labels: np.ndarray
    class_names: list[str]
    label_column: str

    def __len__(self) -> int:
        return len(self.labels)

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=len(self.class_names))

    def majority_share(self) -> float:
        """The accuracy of always answering the most frequent class: chance."""
        return float(self.class_counts().max() / len(self.labels))

    def first(self, count: int) -> LabelledSplit:
        """The split's first ``count`` rows."""
        rows = np.arange(min(count, len(self)))
        return LabelledSplit(self.source.select(rows), self.labels[rows], self.class_names, self.label_column)


def _row_names(source: ImageTextSource, label_column: str, label_flag: str) -> list[str]:
    names = source.captions()
    for row, name in enumerate(names):
        if name is None or not str(name).strip():
            raise DataError(
                f"{source.name}: row {row} has no value in label column {label_column!r} ({label_flag}); drop "
                "unlabelled rows first"
            )
    return [str(name) for name in names]


def labelled_splits(
    dataset_name: str | None = None,
    *,
    train_split: str,
    eval_split: str,
    label_column: str,
    image_column: str = "image",
    data: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> tuple[LabelledSplit, LabelledSplit]:
    """The split the shots come from and the split accuracy is measured on.

    The classes are those of the training split, in the order of a ``ClassLabel`` column's names (sorted for a
    text column).

    Args:
        dataset_name: The dataset, in any form ``vlfit.data.sources.open_splits`` opens.
        train_split: The split the shots come from.
        eval_split: The split accuracy is measured on (may be ``train_split``).
        label_column: The class column.
        image_column: The image column.
        data: More ``open_splits`` keyword arguments: ``train_file``, ``validation_file``, ``test_file`` (splits
            ``train``, ``validation``, ``test``), ``dataset_config_name``, ``data_dir``, ``cache_dir``...
        flags: The flags that name the label column and the two splits in error messages (keys ``label``,
            ``train_split``, ``eval_split``; defaults ``--label_column``, ``--train_split``, ``--eval_split``).

    Raises:
        DataError: naming the flag, when the label column or a split does not exist, a row has no label, the
            training split holds fewer than two classes, or the evaluation split holds a class the training split
            lacks.
    """
    from vlfit.data.sources import open_splits  # only here: it imports the datasets library

    flags = {"label": "--label_column", "train_split": "--train_split", "eval_split": "--eval_split", **(flags or {})}
    label_flag = flags["label"]
    opened = open_splits(
        dataset_name=dataset_name,
        **(data or {}),
        image_column=image_column,
        caption_column=label_column,
        caption_role="label",
        caption_flag=label_flag,
    )
    for split, flag in ((train_split, flags["train_split"]), (eval_split, flags["eval_split"])):
        if split not in opened:
            given = dataset_name or "the data files given"
            raise DataError(f"{given} has no split {split!r}; its splits: {', '.join(opened)}. Pick one with {flag}")
    train_source, eval_source = opened[train_split], opened[eval_split]
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
