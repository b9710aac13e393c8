"""The output columns of a prepared split: the source's names and features, so the shards read back alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow as pa

from vlfit.data.columns import default_id_column
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.sources.arrow import ArrowSource
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import DataError

# The columns copied along by default: those evaluation reads besides image, caption and id.
DEFAULT_EXTRA_COLUMNS: tuple[str, ...] = EVAL_COLUMNS


@dataclass(frozen=True)
class OutputColumns:
    """Column names and features of one split's output.

    Args:
        image: Image column (an ``Image`` feature holding ``{bytes, path}``).
        caption: Caption column.
        id: Id column: the source's id column, else ``instance_id`` holding the ids the source generated.
        extras: Extra columns copied from the source.
        features: Features of all of these, written into the parquet schema metadata.
        image_id: Image id column (``--image_id_column``: which image a row shows, ``Record.image_id``), so the
            shards group captions into images as the source does; ``None``: rows are grouped by their bytes, which
            re-encoding keeps equal for equal source bytes.
    """

    image: str
    caption: str
    id: str
    extras: tuple[str, ...]
    features: datasets.Features
    image_id: str | None = None


def _infer_feature(value: Any) -> datasets.features.features.FeatureType:
    if value is None:
        return datasets.Value("string")
    return datasets.Features.from_arrow_schema(pa.schema([pa.field("x", pa.array([value]).type)]))["x"]


def output_columns(
    split: str,
    source: ImageTextSource,
    *,
    image_column: str,
    caption_column: str,
    id_column: str | None = None,
    extra_columns: Sequence[str] = DEFAULT_EXTRA_COLUMNS,
    image_id_column: str | None = None,
) -> OutputColumns:
    """Decide the output columns of a split so that it reads back exactly as the source did.

    The id column keeps the source's name (``id_column``, else ``instance_id`` or ``id`` when the source has
    one); ids the source generated (row-based ids, tar keys) are written to ``instance_id``. Extra column
    features come from the source's features when it has them, else from the first record's values.

    Args:
        split: Split name (for error messages).
        source: The split's source, opened with the same column arguments.
        image_column: Source image column; the output uses the same name.
        caption_column: Source caption column; the output uses the same name.
        id_column: Source id column, as given to ``open_splits``.
        extra_columns: Extra columns to copy when the source has them.
        image_id_column: Source image id column, as given to ``open_splits``; the output uses the same name.

    Returns:
        The output columns and features.
    """
    if isinstance(source, ArrowSource):
        id_name = id_column or default_id_column(source.column_names) or "instance_id"
        known = source.dataset.features
        extras = tuple(c for c in extra_columns if c in source.column_names)
        extra_features = {c: known[c] for c in extras}
    else:
        id_name = id_column or "instance_id"
        first = source[0].extra if len(source) else {}
        extras = tuple(c for c in extra_columns if c in first)
        extra_features = {c: _infer_feature(first[c]) for c in extras}
    extras = tuple(c for c in extras if c != image_id_column)
    extra_features = {c: f for c, f in extra_features.items() if c in extras}
    names = [image_column, caption_column, id_name, *extras, *([image_id_column] if image_id_column else [])]
    if len(set(names)) != len(names):
        raise DataError(f"split {split!r}: output columns {names} are not distinct; check the column arguments")
    features = datasets.Features(
        {
            image_column: datasets.Image(),
            caption_column: datasets.Value("string"),
            id_name: datasets.Value("string"),
            **extra_features,
            **({image_id_column: datasets.Value("string")} if image_id_column else {}),
        }
    )
    return OutputColumns(image_column, caption_column, id_name, extras, features, image_id_column)
