"""WebDataset tar shards: local ones as a map-style source read in place by member offset (no extraction,
``TarSource``), and shards at URLs to index one at a time (``ShardCollection``).

Which member of a sample is its image, caption and extra columns is ``vlfit.data.webdataset``'s to say: the
streaming reader of shards over URLs (``vlfit.data.stream``) reads by the same rules, so a shard reads the same
either way.
"""

from __future__ import annotations

import contextlib
import os
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vlfit.data.records import BadRecordError, Record
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.webdataset import WebDatasetLayout, split_member_name
from vlfit.errors import DataError

if TYPE_CHECKING:
    from vlfit.data.stream import ShardReader


def _member_at(shard: str, members: Mapping[str, tuple[int, int]], ext: str = "json") -> bytes | None:
    """The bytes of a sample's ``ext`` member, from its ``(offset, size)`` in ``shard`` (``None`` without one)."""
    if ext not in members:
        return None
    offset, size = members[ext]
    with open(shard, "rb") as file:
        file.seek(offset)
        return file.read(size)


class TarSource(ImageTextSource):
    """A source over WebDataset tar shards, read in place (no extraction) by offset.

    Members are grouped into samples by key (the member path up to the first dot of its basename, wherever in the
    shard they are); ``WebDatasetLayout`` says which member is the image, the caption and each extra column.

    Args:
        shards: Paths of uncompressed ``.tar`` files.
        name: Description used in error messages.
        image_column: The image member extension (``WebDatasetLayout``: the default finds the common ones).
        caption_column: The caption member extension, or the key in the ``.json`` member (likewise).
        extra_columns: Values copied into ``Record.extra`` when present.
        image_id_column: A member extension or ``.json`` key naming the image a sample shows
            (``Record.image_id``), read like an extra column; ``None``: samples are grouped by their image bytes.

    Raises:
        DataError: when a sample has no image member (naming shard and key), no caption source exists, or a
            shard's first sample lacks a column named on purpose (``WebDatasetLayout.check_columns``).
    """

    def __init__(
        self,
        shards: Sequence[str],
        *,
        name: str,
        image_column: str = "image",
        caption_column: str = "txt",
        extra_columns: Sequence[str] = (),
        image_id_column: str | None = None,
    ) -> None:
        self._shards = [os.path.abspath(s) for s in shards]
        self._layout = layout = WebDatasetLayout(image_column, caption_column, tuple(extra_columns), image_id_column)
        keys: list[str] = []
        shard_ids: list[int] = []
        # Per sample: (offset, size) of the image, caption-text and json members; (-1, 0) when absent.
        image_loc: list[tuple[int, int]] = []
        text_loc: list[tuple[int, int]] = []
        json_loc: list[tuple[int, int]] = []
        extra_loc: list[list[tuple[int, int]]] = []
        extensions: dict[str, None] = {}
        absent = (-1, 0)
        for shard_id, shard in enumerate(self._shards):
            for number, (key, members) in enumerate(self._index_shard(shard)):
                if number == 0:  # the columns named on purpose, as a stream of the shard checks them
                    layout.check_columns(shard, key, members, layout.parse_json(key, _member_at(shard, members)))
                extensions.update(dict.fromkeys(members))
                parts = layout.members(members)
                if parts.image is None:
                    raise DataError(f"{name}: {layout.missing_image(key, shard, members)}")
                keys.append(key)
                shard_ids.append(shard_id)
                image_loc.append(members[parts.image])
                text_loc.append(members[parts.text] if parts.text else absent)
                json_loc.append(members.get("json", absent))
                extra_loc.append([members[e] if e else absent for e in parts.extras])
        super().__init__(name=name, column_names=list(extensions), num_rows=len(keys))
        self._keys = keys
        self._shard_ids = np.asarray(shard_ids, dtype=np.int32)
        self._image_loc = np.asarray(image_loc, dtype=np.int64).reshape(-1, 2)
        self._text_loc = np.asarray(text_loc, dtype=np.int64).reshape(-1, 2)
        self._json_loc = np.asarray(json_loc, dtype=np.int64).reshape(-1, 2)
        self._extra_loc = np.asarray(extra_loc, dtype=np.int64).reshape(len(keys), len(layout.read_columns), 2)
        self._pid: int | None = None
        self._fds: dict[int, int] = {}
        self._check_caption_source(name, extensions)

    @staticmethod
    def _index_shard(shard: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        samples: dict[str, dict[str, tuple[int, int]]] = {}
        try:
            with tarfile.open(shard, mode="r:") as archive:
                for member in archive:
                    if not member.isfile():
                        continue
                    parts = split_member_name(member.name)
                    if parts is None:
                        continue
                    key, ext = parts
                    samples.setdefault(key, {})[ext] = (member.offset_data, member.size)
        except tarfile.TarError as err:
            raise DataError(f"cannot index tar shard {shard} (only uncompressed .tar is supported): {err}") from err
        return list(samples.items())

    def _check_caption_source(self, name: str, extensions: dict[str, None]) -> None:
        if len(self) == 0 or (self._text_loc[:, 0] >= 0).any():
            return
        if not (self._json_loc[:, 0] >= 0).any():
            raise DataError(
                f"{name}: no caption found: samples have no {self._layout.caption_column!r} or 'txt' member and no "
                f"'json' member; member extensions present: {list(extensions)}"
            )
        # Check one json member now, so a wrong caption_column fails at open time rather than mid-training.
        first = int(np.argmax(self._json_loc[:, 0] >= 0))
        meta = self._load_json(first)
        if self._layout.caption_key(meta) not in meta:
            raise DataError(
                f"{name}: caption key {self._layout.caption_key(meta)!r} not found in the json of sample "
                f"{self._keys[first]!r} ({self._shards[self._shard_ids[first]]}); keys present: {sorted(meta)}"
            )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pid"], state["_fds"] = None, {}  # descriptors belong to the pickling process
        return state

    def __del__(self) -> None:
        try:  # noqa: SIM105 - at interpreter shutdown module globals such as contextlib may already be gone
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Close the file descriptors this process opened (they reopen on the next read)."""
        fds = getattr(self, "_fds", {})
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        fds.clear()

    def _fd(self, shard_id: int) -> int:
        if self._pid != os.getpid():
            # After fork the inherited descriptors share offsets with the parent; close our copies and reopen.
            self.close()
            self._pid = os.getpid()
        fd = self._fds.get(shard_id)
        if fd is None:
            fd = os.open(self._shards[shard_id], os.O_RDONLY | getattr(os, "O_BINARY", 0))
            kept = self._fds.setdefault(shard_id, fd)
            if kept != fd:  # another thread opened it first
                os.close(fd)
                fd = kept
        return fd

    def _read_member(self, row: int, offset: int, size: int) -> bytes:
        shard_id = int(self._shard_ids[row])
        fd = self._fd(shard_id)
        if hasattr(os, "pread"):  # positional read: no shared seek position between threads
            data = os.pread(fd, size, offset)
        else:  # pragma: no cover - Windows
            os.lseek(fd, offset, os.SEEK_SET)
            data = os.read(fd, size)
        if len(data) != size:
            raise BadRecordError(
                f"sample {self._keys[row]}: shard {self._shards[shard_id]} is truncated "
                f"(read {len(data)} of {size} bytes at offset {offset})"
            )
        return data

    def _member(self, row: int, location: np.ndarray) -> bytes | None:
        offset, size = location
        return None if offset < 0 else self._read_member(row, int(offset), int(size))

    def _load_json(self, row: int) -> dict[str, Any]:
        return self._layout.parse_json(self._keys[row], self._member(row, self._json_loc[row]))

    def _read(self, row: int) -> Record:
        image = self._member(row, self._image_loc[row])
        assert image is not None  # every indexed sample has an image member
        extras = [self._member(row, location) for location in self._extra_loc[row]]
        meta = self._load_json(row)
        return self._layout.record(self._keys[row], image, self._member(row, self._text_loc[row]), meta, extras)

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self._keys[int(row)] for row in self._positions(rows)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        """From the image id member or ``.json`` key (the image member is never read)."""
        if self._layout.image_id_column is None:
            return super()._read_image_ids(rows)
        image_ids = []
        for row in (int(r) for r in self._positions(rows)):
            extras = [self._member(row, location) for location in self._extra_loc[row]]
            image_ids.append(self._layout.record(self._keys[row], b"", None, self._load_json(row), extras).image_id)
        return image_ids

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        order = range(self._num_rows) if rows is None else (int(r) for r in rows)
        captions = []
        for row in order:
            text = self._member(row, self._text_loc[row])
            captions.append(self._layout.caption(text, {} if text is not None else self._load_json(row)))
        return captions


@dataclass(frozen=True)
class ShardCollection:
    """WebDataset tar shards at URLs, to index one shard at a time: each is fetched to a local copy beside the
    index, embedded and deleted (``vlfit.index``'s build), so the disk holds two shards, not the set.

    Attributes:
        spec: The shards as given (``--dataset_name``: a URL pattern, or ``::``-joined ones).
        urls: Every shard, in the order the spec expands to.
        layout: Which members are a sample's image and caption.
        retries: Times a failing shard is fetched again (with backoff) before it is given up.
        timeout: Seconds a connection or one read may take.
        backoff: Seconds before the first retry (doubling after).
        storage_options: fsspec options (``--storage_options``: headers, auth...).
        block_size: Bytes per HTTP request (``--shard_block_size``; 0: whole-file streams; ``None``: fsspec's,
            with servers that ignore Range requests detected).
    """

    spec: str
    urls: tuple[str, ...]
    layout: WebDatasetLayout
    retries: int = 3
    timeout: float = 60.0
    backoff: float = 1.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    block_size: int | None = None

    def reader(self) -> ShardReader:
        """How the shards are fetched (``vlfit.data.stream.ShardReader``)."""
        from vlfit.data.stream import ShardReader

        return ShardReader(
            self.layout,
            retries=self.retries,
            timeout=self.timeout,
            backoff=self.backoff,
            storage_options=dict(self.storage_options),
            block_size=self.block_size,
        )

    @property
    def name(self) -> str:
        return f"{len(self.urls)} shard{'s' * (len(self.urls) != 1)} of {self.spec}"
