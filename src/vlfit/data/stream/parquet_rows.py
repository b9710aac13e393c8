"""One parquet shard's rows as stream samples: the files a hub dataset (or ``vlfit prepare``) is made of.

A parquet file is read a row group at a time through its footer's row counts, so a stream resumed at row ``n``
reads from the row group holding it, not from the start. The columns are those ``vlfit train`` reads map-style:
the image (a datasets ``Image`` struct of bytes and path, or raw bytes), the caption, ``instance_id`` or ``id``
as the sample id when present (else ``<file stem>-<row>``), the image id and the extra columns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import IO
from urllib.parse import urlsplit

from vlfit.data.bad_samples import BadSampleInfo
from vlfit.data.columns import as_caption, default_id_column, resolve_column
from vlfit.data.records import BadRecordError, Record, image_value_to_bytes
from vlfit.data.stream.tar_members import NotAShardError
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.errors import DataError

PARQUET_EXTENSION = ".parquet"


def is_parquet(url: str) -> bool:
    """Whether ``url`` names a parquet file (by its extension, query strings aside)."""
    return urlsplit(url).path.lower().endswith(PARQUET_EXTENSION) if "://" in url else url.lower().endswith(".parquet")


def parquet_rows(
    file: IO[bytes], url: str, layout: WebDatasetLayout, wanted: int
) -> Iterator[tuple[int, Record | BadSampleInfo]]:
    """``(row, record)`` of every row from ``wanted`` on; ``(row, (id, reason))`` for a row without a usable image.

    Raises:
        DataError: when the file lacks the image or caption column (naming the columns it has).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except pa.ArrowInvalid as err:  # "Parquet magic bytes not found": an error page, another format
        raise NotAShardError(f"not a parquet file: {err}") from err
    names = parquet.schema_arrow.names
    # The columns as the map-style read finds them: a flag left at its default finds the common names.
    image_column = resolve_column("image", layout.image_column, names, name=f"shard {url}", flag="--image_column")
    caption_column = resolve_column(
        "caption", layout.caption_column, names, name=f"shard {url}", flag="--caption_column"
    )
    id_column = default_id_column(names)
    extras = [column for column in layout.read_columns if column in names]
    columns = list(dict.fromkeys(c for c in (image_column, caption_column, id_column, *extras) if c))
    stem = os.path.splitext(os.path.basename(urlsplit(url).path if "://" in url else url))[0]
    first = 0
    for group in range(parquet.num_row_groups):
        count = parquet.metadata.row_group(group).num_rows
        if first + count <= wanted:
            first += count
            continue
        rows = parquet.read_row_group(group, columns=columns).to_pylist()
        for row_number, row in enumerate(rows, start=first):
            if row_number < wanted:
                continue
            sample_id = str(row[id_column]) if id_column and row[id_column] is not None else f"{stem}-{row_number}"
            try:
                image = image_value_to_bytes(row[image_column], sample_id=sample_id)
            except BadRecordError as err:
                yield row_number, (sample_id, f"{err} (shard {url})")
                continue
            image_id = row.get(layout.image_id_column) if layout.image_id_column else None
            extra = {column: row[column] for column in layout.extra_columns if column in row}
            caption = row[caption_column]
            if isinstance(caption, list):
                raise DataError(
                    f"shard {url}, row {row_number}: the caption column {caption_column!r} holds a list of "
                    "captions; a stream reads one caption per row (open the split map-style, without --streaming, "
                    "to read each caption as a sample)"
                )
            caption = as_caption(caption)
            yield row_number, Record(sample_id, image, caption, extra, None if image_id is None else str(image_id))
        first += count


__all__ = ["PARQUET_EXTENSION", "is_parquet", "parquet_rows"]
