"""A copy of a split's rows with columns added (``vlfit filter``'s score, ``vlfit mine``'s negatives), written as
``vlfit prepare`` writes a split: parquet shards of its output columns (``vlfit.data.prepare``: the names, the file
names), the source's image bytes as they are, so the folder reads back with ``open_splits(dataset_name=folder)`` and
``vlfit train --dataset_name folder``; and the bad samples left out of it, listed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from vlfit.data.bad_samples import BAD_SAMPLES_REPORT, clean_caption
from vlfit.data.batch import BadSample
from vlfit.data.prepare.columns import output_columns
from vlfit.data.prepare.shards import DEFAULT_SHARD_SIZE, shard_file_name
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import ConfigError

_ROW_GROUP_SIZE = 100  # rows per parquet row group, as vlfit prepare writes: a reader buffers few images at once


@dataclass(frozen=True)
class AddedColumn:
    """A column a copy adds: its name, its datasets feature, one value per row written, and the flag that names it
    (for the refusal of a name the split has already)."""

    name: str
    feature: Any
    values: Sequence[Any]
    flag: str


def write_split(
    folder: str,
    split: str,
    source: ImageTextSource,
    rows: Sequence[int],
    added: Sequence[AddedColumn] = (),
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    **columns: Any,
) -> list[str]:
    """Write ``rows`` of ``source`` (their image bytes as stored, caption, id and extra columns, as ``vlfit prepare``
    names them) with the ``added`` columns into parquet shards of ``split`` in ``folder``.

    Args:
        columns: The column keywords of ``vlfit.data.prepare.output_columns`` (``image_column``, ``caption_column``,
            ``id_column``, ``extra_columns``, ``image_id_column``), as ``source`` was opened with (``open_splits``'
            defaults where left out).

    Returns:
        The shard file names (none for no rows: an empty split has no file).

    Raises:
        ConfigError: for an added column the split has already, naming its flag.
    """
    defaults = {"image_column": "image", "caption_column": "image_description", "extra_columns": ()}
    cols = output_columns(split, source, **{**defaults, **columns})
    for column in added:
        if column.name in cols.features:
            raise ConfigError(f"{column.flag} {column.name!r} is a column of split {split!r} already: name another")
    features = datasets.Features({**cols.features, **{column.name: column.feature for column in added}})
    count = -(-len(rows) // shard_size)
    names = []
    for index in range(count):
        chosen = range(index * shard_size, min(len(rows), (index + 1) * shard_size))
        values: dict[str, list[Any]] = {name: [] for name in features}
        for i in chosen:
            record = source[int(rows[i])]
            values[cols.image].append({"bytes": record.image, "path": None})
            values[cols.caption].append(clean_caption(record.caption, record.id))
            values[cols.id].append(record.id)
            for name in cols.extras:
                values[name].append(record.extra.get(name))
            if cols.image_id:
                values[cols.image_id].append(record.image_id)
            for column in added:
                values[column.name].append(column.values[i])
        table = pa.Table.from_pydict(features.encode_batch(values), schema=features.arrow_schema)
        names.append(shard_file_name(split, index, count))
        pq.write_table(table, os.path.join(folder, names[-1]), row_group_size=_ROW_GROUP_SIZE)
    return names


def write_bad_samples(folder: str, bad_samples: Mapping[str, Sequence[BadSample]]) -> None:
    """``bad_samples.jsonl`` in ``folder``: one line per bad sample left out of a copy (split, id, reason); no file
    when there are none."""
    lines = [json.dumps({"split": split, "id": b.id, "reason": b.reason}) for split, bad in bad_samples.items()
             for b in bad]  # fmt: skip
    if lines:
        with open(os.path.join(folder, BAD_SAMPLES_REPORT), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
