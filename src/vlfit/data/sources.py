"""Map-style image-text sources: Arrow-backed datasets and WebDataset tar shards, yielding encoded bytes only.

Every source has a length and integer indexing (so samplers can shard and resume exactly), reads image bytes
without decoding them, and is safe to pickle or use after ``fork`` (file handles are opened lazily per process).
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import math
import operator
import os
import re
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from vlfit.data.records import BadRecordError, Record, image_value_to_bytes

SUPPORTED_FILE_EXTENSIONS: tuple[str, ...] = (".parquet", ".jsonl", ".json", ".csv", ".tar")
_BUILDER_FOR_EXTENSION = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
WEBDATASET_IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
# Split names recognised in local parquet folders, from file-name prefixes (`train-*.parquet`) or folder names.
KNOWN_SPLIT_NAMES: tuple[str, ...] = ("train", "validation", "valid", "val", "dev", "test", "eval")
_HUB_SHARD_NAME = re.compile(r"^(?P<split>[\w.]+?)-\d+-of-\d+")


@dataclass(frozen=True)
class _Columns:
    image: str
    caption: str
    id: str | None
    extras: tuple[str, ...]


class ImageTextSource(ABC):
    """A map-style collection of image-text records.

    Subclasses implement ``_read`` and ``_read_captions`` on *underlying* row numbers; this class maps the
    public (possibly ``select``-ed) indices onto them.

    Attributes:
        column_names: The columns (or, for tar shards, member extensions) the underlying data has.
        name: A human-readable description (split and files) used in error messages.
    """

    column_names: list[str]
    name: str

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


def _as_caption(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):  # CSV readers turn empty cells into NaN
        return None
    if isinstance(value, bytes):  # a binary column: decode it (str() would give "b'...'"), as tar captions are
        return value.decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


class ArrowSource(ImageTextSource):
    """A source over a ``datasets.Dataset`` (hub, ``save_to_disk``, parquet, JSON lines or CSV).

    Args:
        dataset: The split's rows.
        name: Description of the split and its origin, used in error messages.
        image_column: Column holding the image (``Image`` feature, ``{bytes, path}``, a path, bytes or PIL image).
        caption_column: Column holding the caption text.
        id_column: Column holding sample ids; ``None`` picks ``instance_id`` or ``id`` when present, else
            ids are ``"{split}-{row}"``.
        extra_columns: Columns copied into ``Record.extra`` when present.
        split: Split name used for generated ids.
        base_dirs: ``(first_row, folder)`` pairs, sorted by ``first_row``: relative image paths in rows from
            ``first_row`` on resolve against ``folder`` (the folder of the file that lists them).

    Raises:
        ValueError: when the image, caption or explicitly requested id column is missing, or captions are not text.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        name: str,
        image_column: str,
        caption_column: str,
        id_column: str | None = None,
        extra_columns: Sequence[str] = (),
        split: str = "train",
        base_dirs: Sequence[tuple[int, str]] = (),
    ) -> None:
        super().__init__(name=name, column_names=dataset.column_names, num_rows=len(dataset))
        available = dataset.column_names
        for role, column in (("image", image_column), ("caption", caption_column), ("id", id_column)):
            if column is not None and column not in available:
                raise ValueError(
                    f"{name}: {role} column {column!r} not found; available columns: {available}. "
                    f"Pass {role}_column=<one of these>."
                )
        if id_column is None:
            id_column = next((c for c in ("instance_id", "id") if c in available), None)
        caption_feature = dataset.features[caption_column]
        if not isinstance(caption_feature, datasets.Value):
            raise ValueError(
                f"{name}: caption column {caption_column!r} holds {caption_feature}, expected one text value per "
                "row (split multi-caption rows into one row per caption first)"
            )
        self._columns = _Columns(
            image_column, caption_column, id_column, tuple(c for c in extra_columns if c in available)
        )
        self._split = split
        self._base_rows = [row for row, _ in base_dirs]
        self._base_dirs = [folder for _, folder in base_dirs]

        needed = list(dict.fromkeys([image_column, caption_column, *self._columns.extras]))
        if id_column is not None and id_column not in needed:
            needed.append(id_column)
        dataset = dataset.select_columns(needed).with_format(None)
        # Rows must carry encoded bytes: decoding happens later, in worker processes.
        for column in needed:
            feature = dataset.features[column]
            if isinstance(feature, datasets.Image) and feature.decode:
                dataset = dataset.cast_column(column, datasets.Image(decode=False))
        self._dataset = dataset

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
        values = self._dataset[row]
        sample_id = str(values[cols.id]) if cols.id is not None else f"{self._split}-{row}"
        image = image_value_to_bytes(values[cols.image], base_dir=self._base_dir(row), sample_id=sample_id)
        extra = {c: values[c] for c in cols.extras}
        return Record(id=sample_id, image=image, caption=_as_caption(values[cols.caption]), extra=extra)

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        # Arrow format reads only the caption column, leaving image bytes untouched.
        column = self._dataset.select_columns([self._columns.caption]).with_format("arrow")[:].column(0)
        if rows is not None:
            column = column.take(rows)
        return [_as_caption(v) for v in column.to_pylist()]


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
    ) -> None:
        self._shards = [os.path.abspath(s) for s in shards]
        self._caption_column = caption_column
        self._extra_columns = tuple(extra_columns)
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
                    raise ValueError(
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
            raise ValueError(f"cannot index tar shard {shard} (only uncompressed .tar is supported): {err}") from err
        return list(samples.items())

    def _check_caption_source(self, name: str, extensions: dict[str, None]) -> None:
        if len(self) == 0 or (self._text_loc[:, 0] >= 0).any():
            return
        if not (self._json_loc[:, 0] >= 0).any():
            raise ValueError(
                f"{name}: no caption found: samples have no {self._caption_column!r} or 'txt' member and no 'json' "
                f"member; member extensions present: {list(extensions)}"
            )
        # Check one json member now, so a wrong caption_column fails at open time rather than mid-training.
        first = int(np.argmax(self._json_loc[:, 0] >= 0))
        meta = self._load_json(first)
        if self._caption_column not in meta:
            raise ValueError(
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
        return _as_caption(meta.get(self._caption_column))

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
        return Record(id=self._keys[row], image=image, caption=self._caption(row, meta), extra=extra)

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        order = range(self._num_rows) if rows is None else (int(r) for r in rows)
        return [self._caption(row, None) for row in order]


# ----------------------------------------------------------------------------------------------- file patterns


def _split_top_level(spec: str) -> list[str]:
    """Split a comma-separated list, leaving commas inside ``{a,b}`` braces alone."""
    parts, depth, current = [], 0, []
    for char in spec:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += char == "{"
        depth -= char == "}" and depth > 0
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def expand_braces(pattern: str) -> list[str]:
    """Expand shell-style braces: ``a-{000..002}.tar`` and ``{train,extra}.tar`` (zero padding is kept).

    Args:
        pattern: A path pattern; text without braces is returned unchanged.

    Returns:
        The expanded patterns, in order.
    """
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end() :], match.group(1)
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        first, last = numeric.groups()
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        step = 1 if int(last) >= int(first) else -1
        options = [str(i).zfill(width) for i in range(int(first), int(last) + step, step)]
    elif "," in body:
        options = body.split(",")
    else:
        return [head + "{" + body + "}" + t for t in expand_braces(tail)]
    return [expanded for option in options for expanded in expand_braces(head + option + tail)]


def resolve_files(spec: str) -> list[str]:
    """Turn a file spec (path, glob, ``{a..b}`` braces, or a comma-separated list of these) into file paths.

    Args:
        spec: The spec as given on the command line.

    Returns:
        Existing file paths; glob matches are sorted, duplicates removed, order otherwise kept.

    Raises:
        FileNotFoundError: naming the pattern that matched nothing or the file that does not exist.
    """
    files: dict[str, None] = {}
    for part in _split_top_level(spec):
        for pattern in expand_braces(os.path.expanduser(part)):
            if glob.has_magic(pattern):
                matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
                if not matches:
                    raise FileNotFoundError(f"no files match the pattern {pattern!r} (from {spec!r})")
                files.update(dict.fromkeys(matches))
            elif os.path.isfile(pattern):
                files[pattern] = None
            else:
                raise FileNotFoundError(f"file not found: {pattern!r} (from {spec!r})")
    if not files:
        raise FileNotFoundError(f"no files given in {spec!r}")
    return list(files)


def _file_extension(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_FILE_EXTENSIONS:
        raise ValueError(
            f"unsupported file {path!r}: extension {ext or '(none)'!r} is not one of {list(SUPPORTED_FILE_EXTENSIONS)}"
        )
    return ext


# ------------------------------------------------------------------------------------------------------ loading


def _load_builder_files(
    builder: str, files: Sequence[str], cache_dir: str | None
) -> tuple[datasets.Dataset, list[tuple[int, str]]]:
    """Load files with a packaged builder; one call per run of files sharing a folder, to know each row's folder."""
    groups: list[tuple[str, list[str]]] = []
    for path in files:
        folder = os.path.dirname(os.path.abspath(path))
        if groups and groups[-1][0] == folder:
            groups[-1][1].append(path)
        else:
            groups.append((folder, [path]))
    parts: list[datasets.Dataset] = []
    base_dirs: list[tuple[int, str]] = []
    rows = 0
    for folder, group in groups:
        part = datasets.load_dataset(builder, data_files=group, split="train", cache_dir=cache_dir)
        base_dirs.append((rows, folder))
        rows += len(part)
        parts.append(part)
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return dataset, base_dirs


def _describe(files: Sequence[str]) -> str:
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"


def _open_files(split: str, files: Sequence[str], columns: _Columns, cache_dir: str | None) -> ImageTextSource:
    extensions = {_file_extension(f) for f in files}
    name = f"split {split!r} ({_describe(files)})"
    if len(extensions) > 1:
        raise ValueError(f"{name}: files of one split must share a format, got extensions {sorted(extensions)}")
    ext = extensions.pop()
    if ext == ".tar":
        caption = columns.caption
        return TarSource(
            files, name=name, image_column=columns.image, caption_column=caption, extra_columns=columns.extras
        )
    dataset, base_dirs = _load_builder_files(_BUILDER_FOR_EXTENSION[ext], files, cache_dir)
    return _arrow_source(dataset, split, name, columns, base_dirs)


def _arrow_source(
    dataset: datasets.Dataset,
    split: str,
    name: str,
    columns: _Columns,
    base_dirs: Sequence[tuple[int, str]] = (),
) -> ArrowSource:
    return ArrowSource(
        dataset,
        name=name,
        image_column=columns.image,
        caption_column=columns.caption,
        id_column=columns.id,
        extra_columns=columns.extras,
        split=split,
        base_dirs=base_dirs,
    )


def _parquet_splits(root: str) -> dict[str, list[str]]:
    """Group the parquet files under ``root`` into splits, by file-name prefix or folder name."""
    files: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))  # skip caches and hidden folders
        files.extend(os.path.join(folder, f) for f in sorted(names) if f.endswith(".parquet"))
    known: dict[str, list[str]] = {}
    unknown: list[str] = []
    for path in files:
        rel = os.path.relpath(path, root).split(os.sep)
        prefix = rel[-1][: -len(".parquet")].split("-")[0]
        folders = [d for d in reversed(rel[:-1]) if d in KNOWN_SPLIT_NAMES]
        split = prefix if prefix in KNOWN_SPLIT_NAMES else next(iter(folders), None)
        if split is None:
            unknown.append(path)
        else:
            known.setdefault(split, []).append(path)
    if not known:  # no split naming at all: everything is training data
        return {"train": files} if files else {}
    for path in unknown:
        rel = os.path.relpath(path, root).split(os.sep)
        shard = _HUB_SHARD_NAME.match(rel[-1])
        split = shard.group("split") if shard else (rel[-2] if len(rel) > 1 else rel[-1][: -len(".parquet")])
        known.setdefault(split, []).append(path)
    return known


def _open_named(
    dataset_name: str,
    *,
    config_name: str | None,
    revision: str | None,
    data_dir: str | None,
    cache_dir: str | None,
    token: str | None,
    columns: _Columns,
) -> dict[str, ImageTextSource]:
    if os.path.isfile(dataset_name):
        raise ValueError(f"dataset_name {dataset_name!r} is a file; pass it as train_file (or validation/test_file)")
    root = os.path.join(dataset_name, data_dir) if data_dir and os.path.isdir(dataset_name) else dataset_name
    if os.path.isdir(root) and any(os.path.isfile(os.path.join(root, f)) for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(root)
        splits = {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
        return {s: _arrow_source(d, s, f"split {s!r} of {root}", columns) for s, d in splits.items()}
    if os.path.isdir(root):
        parquet = _parquet_splits(root)
        if parquet:
            sources: dict[str, ImageTextSource] = {}
            for split, files in parquet.items():
                dataset, base_dirs = _load_builder_files("parquet", files, cache_dir)
                name = f"split {split!r} of {root} ({_describe(files)})"
                sources[split] = _arrow_source(dataset, split, name, columns, base_dirs)
            return sources
    # A hub id, or a local folder that the datasets library knows how to read (for example a cloned hub repo).
    loaded = datasets.load_dataset(
        dataset_name, config_name, revision=revision, cache_dir=cache_dir, token=token, data_dir=data_dir
    )
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if not isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"{dataset_name}: expected a map-style DatasetDict, got {type(loaded).__name__}")
    label = dataset_name if config_name is None else f"{dataset_name} ({config_name})"
    return {s: _arrow_source(d, s, f"split {s!r} of {label}", columns) for s, d in loaded.items()}


def open_splits(
    *,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    dataset_revision: str | None = None,
    data_dir: str | None = None,
    cache_dir: str | None = None,
    token: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    test_file: str | None = None,
    image_column: str = "image",
    caption_column: str = "image_description",
    id_column: str | None = None,
    extra_columns: Sequence[str] = (),
) -> dict[str, ImageTextSource]:
    """Open every split of an image-text dataset as a map-style source.

    ``dataset_name`` may be a hub id, a local ``save_to_disk`` folder (a ``DatasetDict``, or a ``Dataset`` that
    becomes split ``train``), or a local folder of parquet files (splits from ``{split}-*.parquet`` names or
    ``{split}/`` folders; with no recognisable split names everything is ``train``). The ``*_file`` arguments
    take ``.parquet``, ``.jsonl``/``.json``, ``.csv`` or WebDataset ``.tar`` files: a path, a glob, ``{000..009}``
    braces, or a comma-separated list. In JSON lines and CSV files, image paths are relative to the file's folder.
    When both are given, the files replace (or add) their splits.

    Args:
        dataset_name: Hub id or local folder.
        dataset_config_name: Hub dataset configuration.
        dataset_revision: Hub revision (branch, tag or commit).
        data_dir: Sub-folder of the dataset to read.
        cache_dir: Where the datasets library caches downloads and converted files.
        token: Hub access token.
        train_file: Files for split ``train``.
        validation_file: Files for split ``validation``.
        test_file: Files for split ``test``.
        image_column: Column holding the image (for tar shards: preferred image member extension).
        caption_column: Column holding the caption (for tar shards: member extension or ``.json`` key).
        id_column: Column holding ids; by default ``instance_id`` or ``id`` when present, else ``"{split}-{row}"``.
        extra_columns: Columns copied into ``Record.extra`` when present (missing ones are left out).

    Returns:
        Split name -> source.

    Raises:
        ValueError: when nothing is given to open, a file has an unsupported extension, or a column is missing.
        FileNotFoundError: when a file pattern matches nothing.
    """
    file_specs = {
        split: spec
        for split, spec in (("train", train_file), ("validation", validation_file), ("test", test_file))
        if spec
    }
    if not dataset_name and not file_specs:
        raise ValueError(
            "no data given: pass dataset_name (a hub id, a save_to_disk folder or a folder of parquet files) "
            "or train_file / validation_file / test_file (.parquet, .jsonl, .json, .csv or .tar)"
        )
    columns = _Columns(image_column, caption_column, id_column, tuple(extra_columns))
    # Resolve every pattern first so a typo fails before any slow dataset loading.
    resolved = {split: resolve_files(spec) for split, spec in file_specs.items()}
    for files in resolved.values():
        for path in files:
            _file_extension(path)
    sources: dict[str, ImageTextSource] = {}
    if dataset_name:
        sources.update(
            _open_named(
                dataset_name,
                config_name=dataset_config_name,
                revision=dataset_revision,
                data_dir=data_dir,
                cache_dir=cache_dir,
                token=token,
                columns=columns,
            )
        )
    for split, files in resolved.items():
        sources[split] = _open_files(split, files, columns, cache_dir)
    return sources
