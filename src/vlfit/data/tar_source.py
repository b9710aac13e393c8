"""WebDataset tar shards as a map-style source, read in place by member offset (no extraction)."""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from vlfit.data.records import BadRecordError, Record
from vlfit.data.source_base import ImageTextSource, as_caption
from vlfit.errors import DataError

WEBDATASET_IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")


def _split_member_name(name: str) -> tuple[str, str] | None:
    """WebDataset grouping: key = path up to the first dot of the basename, extension = the rest."""
    folder, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{folder}/{stem}" if folder else stem), ext


class TarSource(ImageTextSource):
    """A source over WebDataset tar shards, read in place (no extraction) by offset.

    Members are grouped into samples by key (the member path up to the first dot of its basename). The image is
    the member whose extension equals ``image_column`` if there is one, else the first of
    ``jpg``/``jpeg``/``png``/``webp``. The caption is the member whose extension equals ``caption_column``, else
    the ``.txt`` member, else ``json[caption_column]``. Extra columns come from a member with that extension
    (parsed as JSON when possible) or from the ``.json`` member. The id is the key.

    Args:
        shards: Paths of uncompressed ``.tar`` files.
        name: Description used in error messages.
        image_column: Preferred image member extension (ignored when no member has it).
        caption_column: Caption member extension, or the key in the ``.json`` member.
        extra_columns: Values copied into ``Record.extra`` when present.
        image_id_column: A member extension or ``.json`` key naming the image a sample shows
            (``Record.image_id``), read like an extra column; ``None``: samples are grouped by their image bytes.

    Raises:
        ValueError: when a sample has no image member (naming shard and key), or no caption source exists.
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
        self._caption_column = caption_column
        self._image_id_column = image_id_column
        self._extra_columns = tuple(dict.fromkeys([*extra_columns, *([image_id_column] if image_id_column else [])]))
        self._returned_extras = tuple(extra_columns)
        keys: list[str] = []
        shard_ids: list[int] = []
        # Per sample: (offset, size) of the image, caption-text and json members; (-1, 0) when absent.
        image_loc: list[tuple[int, int]] = []
        text_loc: list[tuple[int, int]] = []
        json_loc: list[tuple[int, int]] = []
        extra_loc: list[list[tuple[int, int]]] = []
        extensions: dict[str, None] = {}
        for shard_id, shard in enumerate(self._shards):
            for key, members in self._index_shard(shard):
                extensions.update(dict.fromkeys(members))
                image_ext = image_column if image_column in members else None
                image_ext = image_ext or next((e for e in WEBDATASET_IMAGE_EXTENSIONS if e in members), None)
                if image_ext is None:
                    raise DataError(
                        f"{name}: sample {key!r} in shard {shard} has no image member (found extensions "
                        f"{sorted(members)}; expected one of {list(WEBDATASET_IMAGE_EXTENSIONS)})"
                    )
                text_ext = caption_column if caption_column in members else "txt"
                keys.append(key)
                shard_ids.append(shard_id)
                image_loc.append(members[image_ext])
                text_loc.append(members.get(text_ext, (-1, 0)))
                json_loc.append(members.get("json", (-1, 0)))
                extra_loc.append([members.get(c, (-1, 0)) for c in self._extra_columns])
        super().__init__(name=name, column_names=list(extensions), num_rows=len(keys))
        self._keys = keys
        self._shard_ids = np.asarray(shard_ids, dtype=np.int32)
        self._image_loc = np.asarray(image_loc, dtype=np.int64).reshape(-1, 2)
        self._text_loc = np.asarray(text_loc, dtype=np.int64).reshape(-1, 2)
        self._json_loc = np.asarray(json_loc, dtype=np.int64).reshape(-1, 2)
        self._extra_loc = np.asarray(extra_loc, dtype=np.int64).reshape(len(keys), len(self._extra_columns), 2)
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
                    parts = _split_member_name(member.name)
                    if parts is None:
                        continue
                    key, ext = parts
                    samples.setdefault(key, {})[ext.lower()] = (member.offset_data, member.size)
        except tarfile.TarError as err:
            raise DataError(f"cannot index tar shard {shard} (only uncompressed .tar is supported): {err}") from err
        return list(samples.items())

    def _check_caption_source(self, name: str, extensions: dict[str, None]) -> None:
        if len(self) == 0 or (self._text_loc[:, 0] >= 0).any():
            return
        if not (self._json_loc[:, 0] >= 0).any():
            raise DataError(
                f"{name}: no caption found: samples have no {self._caption_column!r} or 'txt' member and no 'json' "
                f"member; member extensions present: {list(extensions)}"
            )
        # Check one json member now, so a wrong caption_column fails at open time rather than mid-training.
        first = int(np.argmax(self._json_loc[:, 0] >= 0))
        meta = self._load_json(first)
        if self._caption_column not in meta:
            raise DataError(
                f"{name}: caption key {self._caption_column!r} not found in the json of sample "
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

    def _load_json(self, row: int) -> dict[str, Any]:
        offset, size = self._json_loc[row]
        if offset < 0:
            return {}
        raw = self._read_member(row, int(offset), int(size))
        try:
            meta = json.loads(raw)
        except ValueError as err:
            raise BadRecordError(f"sample {self._keys[row]}: invalid json member: {err}") from err
        return meta if isinstance(meta, dict) else {}

    def _text(self, row: int, offset: int, size: int) -> str:
        # Invalid UTF-8 becomes U+FFFD rather than a bad sample: web captions often carry a few mis-encoded
        # bytes in otherwise good text (see vlfit.data.bad_samples).
        return self._read_member(row, offset, size).decode("utf-8", errors="replace").strip()

    def _caption(self, row: int, meta: dict[str, Any] | None) -> str | None:
        offset, size = self._text_loc[row]
        if offset >= 0:
            return self._text(row, int(offset), int(size))
        if meta is None:
            meta = self._load_json(row)
        return as_caption(meta.get(self._caption_column))

    def _read(self, row: int) -> Record:
        offset, size = self._image_loc[row]
        image = self._read_member(row, int(offset), int(size))
        meta = self._load_json(row) if self._json_loc[row, 0] >= 0 else {}
        extra: dict[str, Any] = {}
        for j, column in enumerate(self._extra_columns):
            e_offset, e_size = self._extra_loc[row, j]
            if e_offset >= 0:
                text = self._text(row, int(e_offset), int(e_size))
                try:
                    extra[column] = json.loads(text)
                except ValueError:
                    extra[column] = text
            elif column in meta:
                extra[column] = meta[column]
        image_id = extra.get(self._image_id_column) if self._image_id_column else None
        extra = {column: extra[column] for column in self._returned_extras if column in extra}
        return Record(
            self._keys[row],
            image,
            self._caption(row, meta),
            extra,
            image_id=None if image_id is None else str(image_id),
        )

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        order = range(self._num_rows) if rows is None else (int(r) for r in rows)
        return [self._caption(row, None) for row in order]
