"""Arrow-backed datasets as a map-style source (``ArrowSource``): hub datasets, ``save_to_disk`` folders, parquet
folders and files, JSON lines and CSV with image paths, all read through the datasets library."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from vlfit.data.columns import Columns, as_caption, default_id_column, resolve_column
from vlfit.data.records import Record, image_value_to_bytes
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import DataError

logger = logging.getLogger(__name__)

# How a text value that is a file name ends (``.jpg``, ``.webp``...): one that does not, and names no file, is text.
_FILE_SUFFIX = re.compile(r"\.[A-Za-z0-9]{2,5}$")


class ArrowSource(ImageTextSource):
    """A source over a ``datasets.Dataset`` (hub, ``save_to_disk``, parquet, JSON lines or CSV).

    Args:
        dataset: The split's rows.
        name: Description of the split and its origin, used in error messages.
        image_column: Column holding the image (``Image`` feature, ``{bytes, path}``, a path, bytes or PIL image).
        caption_column: Column holding the caption text, or a class label (``ClassLabel``: its names are the
            captions), or a list of captions per image (each caption is then a record of its own, id
            ``{id}#{k}``, and a row with an empty list has none); ``None`` for images only (each caption is then
            the sample id, which nothing embeds).
        id_column: Column holding sample ids; ``None`` picks ``instance_id`` or ``id`` when present, else
            ids are ``"{split}-{row}"``.
        extra_columns: Columns copied into ``Record.extra`` when present.
        split: Split name used for generated ids.
        base_dirs: ``(first_row, folder)`` pairs, sorted by ``first_row``: relative image paths in rows from
            ``first_row`` on resolve against ``folder`` (the folder of the file that lists them).
        caption_role: What the caption column is called in error messages (``label``: ``vlfit fewshot``'s class
            column, its flag ``--label_column``).
        image_id_column: Column naming which image a row shows (``Record.image_id``): rows with equal values are
            captions of one image. ``None``: rows are grouped by their image bytes.
        caption_flag: The flag that names the caption column, for error messages (default
            ``--{caption_role}_column``).

    The image and caption columns at their defaults (``image``, ``image_description``) stand for the common names
    of ``vlfit.data.columns.DEFAULT_COLUMNS``: the first present is read.

    Attributes:
        class_names: The names of a ``ClassLabel`` caption column, in label order (``None`` for text captions).

    Raises:
        DataError: naming the flag, when the image, caption or explicitly requested id column is missing, or
            captions are not text.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        name: str,
        image_column: str,
        caption_column: str | None,
        id_column: str | None = None,
        extra_columns: Sequence[str] = (),
        split: str = "train",
        base_dirs: Sequence[tuple[int, str]] = (),
        caption_role: str = "caption",
        image_id_column: str | None = None,
        caption_flag: str | None = None,
    ) -> None:
        super().__init__(name=name, column_names=dataset.column_names, num_rows=len(dataset))
        available = dataset.column_names
        caption_flag = caption_flag or f"--{caption_role}_column"
        image_column = resolve_column("image", image_column, available, name=name, flag="--image_column")
        named = ((caption_role, caption_column, caption_flag), ("id", id_column, "--id_column"),
                 ("image_id", image_id_column, "--image_id_column"))  # fmt: skip
        resolved = [None if column is None else resolve_column(role, column, available, name=name, flag=flag)
                    for role, column, flag in named]  # fmt: skip
        caption_column, id_column, image_id_column = resolved
        if id_column is None:
            id_column = default_id_column(available)
        caption_feature = dataset.features[caption_column] if caption_column is not None else datasets.Value("string")
        caption_lists = caption_role == "caption" and _is_text_list(caption_feature)
        if not (caption_lists or isinstance(caption_feature, (datasets.Value, datasets.ClassLabel))):
            expected = "one text value per row, or a list of texts" if caption_role == "caption" else "one value"
            raise DataError(
                f"{name}: {caption_role} column {caption_column!r} holds {caption_feature}, expected {expected} "
                f"per row; name another column with {caption_flag}"
            )
        self.class_names: list[str] | None = (
            list(caption_feature.names) if isinstance(caption_feature, datasets.ClassLabel) else None
        )
        self._columns = Columns(
            image_column,
            caption_column,
            id_column,
            tuple(c for c in extra_columns if c in available),
            image_id=image_id_column,
        )
        self._split = split
        self._base_rows = [row for row, _ in base_dirs]
        self._base_dirs = [folder for _, folder in base_dirs]

        needed = list(dict.fromkeys(c for c in (image_column, caption_column, *self._columns.extras) if c))
        for column in (id_column, image_id_column):
            if column is not None and column not in needed:
                needed.append(column)
        dataset = dataset.select_columns(needed).with_format(None)
        # Rows must carry encoded bytes: decoding happens later, in worker processes.
        for column in needed:
            feature = dataset.features[column]
            if isinstance(feature, datasets.Image) and feature.decode:
                dataset = dataset.cast_column(column, datasets.Image(decode=False))
        self._dataset = dataset
        _check_image_column(dataset, image_column, self._base_dir(0), name=name, available=available)
        # A list column: one record per caption. Record r is caption _caption_index[r] of row _caption_rows[r].
        self._caption_rows: np.ndarray | None = None
        self._caption_index: np.ndarray | None = None
        if caption_lists:
            lengths = pc.list_value_length(self._arrow_column(caption_column)).fill_null(0).to_numpy()
            lengths = lengths.astype(np.int64)
            self._caption_rows = np.repeat(np.arange(len(dataset)), lengths)
            self._caption_index = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            self._num_rows = len(self._caption_rows)
            if (lengths == 0).any():
                logger.warning("%s: %d of %d rows have no caption in list column %r: their images are left out",
                               name, int((lengths == 0).sum()), len(lengths), caption_column)  # fmt: skip

    @property
    def dataset(self) -> datasets.Dataset:
        """The underlying dataset, reduced to the columns this source reads (all rows, ignoring ``select``)."""
        return self._dataset

    def _base_dir(self, row: int) -> str | None:
        if not self._base_rows:
            return None
        pos = int(np.searchsorted(self._base_rows, row, side="right")) - 1
        return self._base_dirs[max(pos, 0)]

    def _read(self, row: int) -> Record:
        cols = self._columns
        caption_index = None
        if self._caption_rows is not None:
            row, caption_index = int(self._caption_rows[row]), int(self._caption_index[row])  # type: ignore[index]
        values = self._dataset[row]
        sample_id = str(values[cols.id]) if cols.id is not None else f"{self._split}-{row}"
        if caption_index is not None:
            sample_id = f"{sample_id}#{caption_index}"
        image = image_value_to_bytes(values[cols.image], base_dir=self._base_dir(row), sample_id=sample_id)
        extra = {c: values[c] for c in cols.extras}
        if cols.caption is None:
            caption = sample_id
        elif caption_index is None:
            caption = self._caption(values[cols.caption])
        else:
            caption = as_caption(values[cols.caption][caption_index])
        image_id = values[cols.image_id] if cols.image_id is not None else None
        return Record(sample_id, image, caption, extra, image_id=None if image_id is None else str(image_id))

    def _caption(self, value: Any) -> str | None:
        if self.class_names is not None and isinstance(value, int) and 0 <= value < len(self.class_names):
            return self.class_names[value]
        return as_caption(value)

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        cols = self._columns
        if cols.caption is None:  # images only: the captions are the sample ids
            if cols.id is None:
                positions = range(len(self._dataset)) if rows is None else rows
                return [f"{self._split}-{int(row)}" for row in positions]
            return [str(value) for value in self._column_values(cols.id, rows)]
        if self._caption_rows is not None:
            captions = pc.list_flatten(self._arrow_column(cols.caption))  # null lists hold no caption
            return [as_caption(value) for value in (captions if rows is None else captions.take(rows)).to_pylist()]
        return [self._caption(value) for value in self._column_values(cols.caption, rows)]

    def _dataset_rows(self, rows: np.ndarray | None) -> np.ndarray:
        """The dataset rows of records ``rows`` (``None``: all of them)."""
        records = np.arange(self._num_rows) if rows is None else np.asarray(rows, dtype=np.int64)
        return records if self._caption_rows is None else self._caption_rows[records]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        """From the id column alone (or the row numbers), as ``_read`` names records."""
        data_rows = self._dataset_rows(rows)
        if self._columns.id is None:
            ids = [f"{self._split}-{int(row)}" for row in data_rows]
        else:
            ids = [str(value) for value in self._column_values(self._columns.id, data_rows)]
        if self._caption_index is None:
            return ids
        index = self._caption_index if rows is None else self._caption_index[np.asarray(rows, dtype=np.int64)]
        return [f"{sample_id}#{int(k)}" for sample_id, k in zip(ids, index, strict=True)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        """From the image id column alone, when there is one."""
        if self._columns.image_id is None:
            return super()._read_image_ids(rows)
        values = self._column_values(self._columns.image_id, self._dataset_rows(rows))
        return [None if value is None else str(value) for value in values]

    def _arrow_column(self, column: str) -> Any:
        # Arrow format reads only that column, leaving image bytes untouched.
        return self._dataset.select_columns([column]).with_format("arrow")[:].column(0)

    def _column_values(self, column: str, rows: np.ndarray | None) -> list[Any]:
        values = self._arrow_column(column)
        if rows is not None:
            values = values.take(rows)
        return values.to_pylist()


def _check_image_column(
    dataset: datasets.Dataset, column: str, base_dir: str | None, *, name: str, available: Sequence[str]
) -> None:
    """Refuse, when the split opens, an image column that holds no images: numbers, lists, or text that names no
    file (a caption column given as ``--image_column``), which every row would fail on once training reads it.

    An ``Image`` feature, bytes and ``{bytes, path}`` structs pass; a text column passes when its first row names
    an existing file or looks like a file name (a missing file is then that row's bad sample, as it always was).
    """
    feature = dataset.features[column]
    if isinstance(feature, datasets.Image):
        return
    if isinstance(feature, datasets.Value) and feature.dtype in ("binary", "large_binary"):
        return
    if isinstance(feature, dict) and {"bytes", "path"} & set(feature):
        return
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        first = dataset.select_columns([column]).with_format("arrow")[:1].column(0).to_pylist() if len(dataset) else []
        value = first[0] if first else None
        if not isinstance(value, str):
            return
        path = value if base_dir is None or os.path.isabs(value) else os.path.join(base_dir, value)
        if os.path.isfile(path) or _FILE_SUFFIX.search(value):
            return
        shown = value if len(value) <= 40 else f"{value[:40]}..."
        holds = f"text that names no file (first row: {shown!r})"
    else:
        holds = f"{feature}"
    raise DataError(
        f"{name}: --image_column {column!r} holds {holds}, not images; name the column of images (an Image "
        f"feature, bytes, or image file paths) with --image_column; its columns: {', '.join(available)}"
    )


def _is_text_list(feature: Any) -> bool:
    """Whether a column feature is a list of texts (several captions per image)."""
    inner = getattr(feature, "feature", None)
    return isinstance(feature, (datasets.List, datasets.LargeList)) and (
        isinstance(inner, datasets.Value) and inner.dtype in ("string", "large_string")
    )
