"""The map-style source interface every storage format implements (``ImageTextSource``).

Every source has a length and integer indexing (so samplers can shard and resume exactly), reads image bytes
without decoding them, and is safe to pickle or use after ``fork`` (file handles are opened lazily per process).
"""

from __future__ import annotations

import copy
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import numpy as np

from vlfit.data.records import Record, image_key


class ImageTextSource(ABC):
    """A map-style collection of image-text records.

    Subclasses implement ``_read`` and ``_read_captions`` on *underlying* row numbers; this class maps the
    public (possibly ``select``-ed) indices onto them.

    Attributes:
        column_names: The columns (or, for tar shards, member extensions) the underlying data has.
        name: A human-readable description (split and files) used in error messages.
        captioned: Whether the records' captions are captions (an image folder's are its paths: an index of it
            stores none).
        item_folder: The folder whose image files are all of this source's images (an image folder: its image
            ids are their absolute paths), or ``None``. An index of it takes files gone from there as removed.
    """

    column_names: list[str]
    name: str
    captioned: bool = True
    item_folder: str | None = None

    def __init__(self, *, name: str, column_names: Sequence[str], num_rows: int) -> None:
        self.name = name
        self.column_names = list(column_names)
        self._num_rows = num_rows
        self._rows: np.ndarray | None = None  # None = identity mapping onto the underlying rows

    def __len__(self) -> int:
        return self._num_rows if self._rows is None else len(self._rows)

    def __getitem__(self, index: int) -> Record:
        """Return the record at ``index`` (negative indices count from the end)."""
        return self._read(self._underlying_row(index))

    def __iter__(self) -> Iterator[Record]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {len(self)} records)"

    def captions(self) -> list[str | None]:
        """Return every caption in index order without reading image bytes (for tokenizer training, stats)."""
        return self._read_captions(self._rows)

    def ids(self) -> list[str]:
        """Every record's ``Record.id`` in index order, without reading image bytes (the id column, file or member
        names)."""
        return self._read_ids(self._rows)

    def image_ids(self) -> list[str | None]:
        """Every record's ``Record.image_id`` in index order, without reading image bytes (``None`` for a record
        known by its bytes)."""
        return self._read_image_ids(self._rows)

    def image_keys(self) -> np.ndarray:
        """Every record's ``Record.image_key``, in index order (int64): which records show the same image.

        From the image ids where records have them; the image bytes (not decoded) of the records that have none.
        """
        keys = [
            self[i].image_key if value is None else image_key(b"", value) for i, value in enumerate(self.image_ids())
        ]
        return np.asarray(keys, dtype=np.int64)

    def select(self, indices: Sequence[int]) -> ImageTextSource:
        """Return a source holding only ``indices`` (in that order); ids stay those of the original rows.

        Args:
            indices: Positions in this source; negative values count from the end.

        Raises:
            IndexError: when an index is out of range.
        """
        positions = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if positions.size and (positions.min() < -n or positions.max() >= n):
            raise IndexError(f"{self.name}: select() index out of range for {n} records")
        positions = np.where(positions < 0, positions + n, positions)
        subset = copy.copy(self)
        subset._rows = positions if self._rows is None else self._rows[positions]
        return subset

    def _underlying_row(self, index: int) -> int:
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.name}: index {index} out of range for {n} records")
        return i if self._rows is None else int(self._rows[i])

    @abstractmethod
    def _read(self, row: int) -> Record: ...

    @abstractmethod
    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]: ...

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        """Each record's id from the record itself; vlfit's sources override this so as not to read images."""
        return [self._read(int(row)).id for row in self._positions(rows)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        """No image ids: every record is known by its bytes (sources with an image id column override this)."""
        return [None] * (self._num_rows if rows is None else len(rows))

    def _positions(self, rows: np.ndarray | None) -> range | np.ndarray:
        """The underlying rows ``rows`` stands for (``None``: all of them)."""
        return range(self._num_rows) if rows is None else rows
