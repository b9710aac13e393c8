"""A source over records held in memory (synthetic scenes, query images, tests): the same interface as every stored
format."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vlfit.data.records import Record
from vlfit.data.sources.base import ImageTextSource


class MemorySource(ImageTextSource):
    """Records in a list; ``select`` (repeats allowed) and the rest come from ``ImageTextSource``.

    Args:
        records: The samples.
        name: A description used in messages and in a prepared copy's manifest.
    """

    def __init__(self, records: Sequence[Record], name: str = "in-memory records") -> None:
        self._records = list(records)
        extras = list(self._records[0].extra) if self._records else []
        super().__init__(
            name=name,
            column_names=["image", "image_description", "instance_id", *extras],
            num_rows=len(self._records),
        )

    def _read(self, row: int) -> Record:
        return self._records[row]

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self._records[int(row)].caption for row in self._positions(rows)]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self._records[int(row)].id for row in self._positions(rows)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        return [self._records[int(row)].image_id for row in self._positions(rows)]
