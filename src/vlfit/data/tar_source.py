"""WebDataset tar shards as a map-style source, read in place by member offset (no extraction).

The rules that turn a sample's members into a ``Record`` (``WebDatasetLayout``) are shared with the streaming
reader of shards over URLs (``vlfit.data.stream``), so a shard reads the same either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlfit.data.records import BadRecordError, Record
from vlfit.data.source_base import DEFAULT_COLUMNS, ImageTextSource, as_caption, is_default_column
from vlfit.errors import DataError

WEBDATASET_IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")


def split_member_name(name: str) -> tuple[str, str] | None:
    """WebDataset grouping: ``(key, extension)`` of a member, the key being the path up to the first dot of the
    basename and the extension the rest (lower-cased); ``None`` for a name without an extension or a hidden file."""
    folder, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


@dataclass(frozen=True)
class SampleMembers:
    """Which member extension of one sample plays which part (``None``: the sample has no such member); the
    ``.json`` member, when there is one, is always ``json``.

    Attributes:
        image: The image member.
        text: The caption member (see ``WebDatasetLayout``).
        extras: Per column of ``WebDatasetLayout.read_columns``, the member holding it.
    """

    image: str | None
    text: str | None
    extras: tuple[str | None, ...]


@dataclass(frozen=True)
class WebDatasetLayout:
    """Where a WebDataset sample keeps its image, caption, extra columns and image id, and how they make a ``Record``.

    For tar shards a column is a member extension (or, for the caption, a key of the ``.json`` member). A column
    flag left at its default (``vlfit.data.source_base.is_default_column``) finds the common members: the image is
    the ``.image`` member or else the first of ``jpg``/``jpeg``/``png``/``webp``; the caption is the member of that
    name, else ``.txt``, else a member or ``.json`` key with one of the common caption names
    (``DEFAULT_COLUMNS["caption"]``). A column named on purpose is that member (the caption: that member, else that
    ``.json`` key), with no fallback: a shard whose first sample has no such thing is a ``DataError`` naming the
    flag, the shard and what the sample has (``check_columns``; a later sample without it has no image or no
    caption, a bad sample). Extra columns come from a member with that extension (parsed as JSON when possible) or
    from the ``.json`` member. The id is the key.

    Args:
        image_column: The image member extension (``--image_column``).
        caption_column: The caption member extension, or the key in the ``.json`` member (``--caption_column``).
        extra_columns: Values copied into ``Record.extra`` when present.
        image_id_column: A member extension or ``.json`` key naming the image a sample shows
            (``Record.image_id``), read like an extra column; ``None``: samples are grouped by their image bytes.
    """

    image_column: str = "image"
    caption_column: str = "txt"
    extra_columns: tuple[str, ...] = ()
    image_id_column: str | None = None

    @property
    def read_columns(self) -> tuple[str, ...]:
        """The extra columns and the image id column, each once: what ``SampleMembers.extras`` lists."""
        ids = [self.image_id_column] if self.image_id_column else []
        return tuple(dict.fromkeys([*self.extra_columns, *ids]))

    @property
    def _image_members(self) -> tuple[str, ...]:
        """The member extensions that may hold the image, in order of preference."""
        if is_default_column("image", self.image_column):
            return (self.image_column, *WEBDATASET_IMAGE_EXTENSIONS)
        return (self.image_column,)

    @property
    def _caption_members(self) -> tuple[str, ...]:
        """The member extensions that may hold the caption, in order of preference."""
        if is_default_column("caption", self.caption_column):
            return tuple(dict.fromkeys((self.caption_column, "txt", *DEFAULT_COLUMNS["caption"])))
        return (self.caption_column,)

    def caption_key(self, meta: Mapping[str, Any]) -> str:
        """The ``.json`` key that holds the caption."""
        if is_default_column("caption", self.caption_column):
            return next((c for c in DEFAULT_COLUMNS["caption"] if c in meta), self.caption_column)
        return self.caption_column

    def members(self, extensions: Collection[str]) -> SampleMembers:
        """The part each of a sample's member extensions plays."""
        image = next((e for e in self._image_members if e in extensions), None)
        text = next((e for e in self._caption_members if e in extensions), None)
        extras = tuple(c if c in extensions else None for c in self.read_columns)
        return SampleMembers(image, text, extras)

    def check_columns(self, shard: str, key: str, extensions: Collection[str], meta: Mapping[str, Any]) -> None:
        """Check a shard's first sample for the columns named on purpose (the defaults find what there is).

        Args:
            shard: The shard, for the message.
            key: The sample's key.
            extensions: Its member extensions.
            meta: Its parsed ``.json`` member (``{}`` without one).

        Raises:
            DataError: naming the flag, the shard and the sample's members and ``.json`` keys, when an explicit
                ``--image_column`` is not one of its members or an explicit ``--caption_column`` neither a member
                nor a ``.json`` key.
        """
        has = f"its first sample {key!r} has members {sorted(extensions)}"
        if not is_default_column("image", self.image_column) and self.image_column not in extensions:
            raise DataError(
                f"--image_column {self.image_column!r}: shard {shard} has no '.{self.image_column}' member ({has}); "
                f"name the image member's extension with --image_column, or leave it out for the first of "
                f"{list(WEBDATASET_IMAGE_EXTENSIONS)}"
            )
        caption = self.caption_column
        if not is_default_column("caption", caption) and caption not in extensions and caption not in meta:
            raise DataError(
                f"--caption_column {caption!r}: shard {shard} has no '.{caption}' member and no .json key {caption!r} "
                f"({has} and .json keys {sorted(meta)}); name the caption's member extension or .json key with "
                "--caption_column, or leave it out for the '.txt' member"
            )

    @staticmethod
    def missing_image(key: str, shard: str, extensions: Collection[str]) -> str:
        """The reason a sample without an image member is refused."""
        return (
            f"sample {key!r} in shard {shard} has no image member (found extensions {sorted(extensions)}; "
            f"expected one of {list(WEBDATASET_IMAGE_EXTENSIONS)})"
        )

    @staticmethod
    def parse_json(key: str, raw: bytes | None) -> dict[str, Any]:
        """The ``.json`` member as a dict (``{}`` without one, or when it holds another JSON value).

        Raises:
            BadRecordError: naming the sample when the member is not valid JSON.
        """
        if raw is None:
            return {}
        try:
            meta = json.loads(raw)
        except ValueError as err:
            raise BadRecordError(f"sample {key}: invalid json member: {err}") from err
        return meta if isinstance(meta, dict) else {}

    def caption(self, text: bytes | None, meta: dict[str, Any]) -> str | None:
        """The caption: the caption member's text when there is one, else the caption's ``.json`` key."""
        return _text(text) if text is not None else as_caption(meta.get(self.caption_key(meta)))

    def record(
        self, key: str, image: bytes, text: bytes | None, meta: dict[str, Any], extras: Sequence[bytes | None]
    ) -> Record:
        """Assemble a sample's record from its members' bytes.

        Args:
            key: The sample's key (its id).
            image: The image member.
            text: The caption member, if any.
            meta: The parsed ``.json`` member (``parse_json``).
            extras: Per column of ``read_columns``, its member's bytes or ``None``.
        """
        extra: dict[str, Any] = {}
        for column, raw in zip(self.read_columns, extras, strict=True):
            if raw is not None:
                value = _text(raw)
                try:
                    extra[column] = json.loads(value)
                except ValueError:
                    extra[column] = value
            elif column in meta:
                extra[column] = meta[column]
        image_id = extra.get(self.image_id_column) if self.image_id_column else None
        extra = {column: extra[column] for column in self.extra_columns if column in extra}
        return Record(key, image, self.caption(text, meta), extra, image_id=None if image_id is None else str(image_id))


def _member_at(shard: str, members: Mapping[str, tuple[int, int]], ext: str = "json") -> bytes | None:
    """The bytes of a sample's ``ext`` member, from its ``(offset, size)`` in ``shard`` (``None`` without one)."""
    if ext not in members:
        return None
    offset, size = members[ext]
    with open(shard, "rb") as file:
        file.seek(offset)
        return file.read(size)


def _text(raw: bytes) -> str:
    # Invalid UTF-8 becomes U+FFFD rather than a bad sample: web captions often carry a few mis-encoded
    # bytes in otherwise good text (see vlfit.data.bad_samples).
    return raw.decode("utf-8", errors="replace").strip()


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
