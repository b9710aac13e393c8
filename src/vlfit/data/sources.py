"""Opening a dataset's splits as image-text sources: hub datasets, ``save_to_disk`` folders, parquet folders and
files, JSON lines/CSV with image paths (all Arrow-backed, ``ArrowSource``) and WebDataset tar shards (``TarSource``).

Sources yield encoded bytes only; see ``vlfit.data.source_base`` for the interface they share.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from vlfit.data.file_patterns import is_stream_spec, resolve_files
from vlfit.data.records import Record, image_value_to_bytes
from vlfit.data.source_base import ImageTextSource, as_caption, default_id_column, resolve_column
from vlfit.data.stream.fetch import spec_files
from vlfit.data.stream.shards import ShardReader
from vlfit.data.tar_source import TarSource
from vlfit.errors import DataError, first_line

SUPPORTED_FILE_EXTENSIONS: tuple[str, ...] = (".parquet", ".jsonl", ".json", ".csv", ".tar")
_BUILDER_FOR_EXTENSION = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# Split names recognised in local parquet folders, from file-name prefixes (`train-*.parquet`) or folder names.
KNOWN_SPLIT_NAMES: tuple[str, ...] = ("train", "validation", "valid", "val", "dev", "test", "eval")
_HUB_SHARD_NAME = re.compile(r"^(?P<split>[\w.]+?)-\d+-of-\d+")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Columns:
    image: str
    caption: str | None
    id: str | None
    extras: tuple[str, ...]
    caption_role: str = "caption"
    image_id: str | None = None
    caption_flag: str | None = None


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
    of ``vlfit.data.source_base.DEFAULT_COLUMNS``: the first present is read.

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
        self._columns = _Columns(
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


def _is_text_list(feature: Any) -> bool:
    """Whether a column feature is a list of texts (several captions per image)."""
    inner = getattr(feature, "feature", None)
    return isinstance(feature, (datasets.List, datasets.LargeList)) and (
        isinstance(inner, datasets.Value) and inner.dtype in ("string", "large_string")
    )


def _file_extension(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_FILE_EXTENSIONS:
        raise DataError(
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
        try:
            part = datasets.load_dataset(builder, data_files=group, split="train", cache_dir=cache_dir)
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{_describe(group)}: cannot read it as {builder}: {first_line(error, 300)}") from error
        base_dirs.append((rows, folder))
        rows += len(part)
        parts.append(part)
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return dataset, base_dirs


def _describe(files: Sequence[str]) -> str:
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"


def _names_files(spec: str) -> bool:
    """Whether a ``dataset_name`` names data files (a file, or a glob/brace pattern or list of them) not a folder."""
    if os.path.isdir(spec):
        return False
    if os.path.isfile(spec):
        return True
    first = spec.split(",")[0].strip()
    return any(c in spec for c in "*?{") and os.path.splitext(first.rstrip("}"))[1].lower() in SUPPORTED_FILE_EXTENSIONS


def _open_files(
    split: str, files: Sequence[str], columns: _Columns, cache_dir: str | None, of: str | None = None
) -> ImageTextSource:
    extensions = {_file_extension(f) for f in files}
    name = f"split {split!r} of {of} ({_describe(files)})" if of else f"split {split!r} ({_describe(files)})"
    if len(extensions) > 1:
        raise DataError(f"{name}: files of one split must share a format, got extensions {sorted(extensions)}")
    ext = extensions.pop()
    if ext == ".tar":
        caption = columns.caption
        if caption is None:
            raise DataError(f"{name}: WebDataset shards are read with a caption member; name it with --caption_column")
        return TarSource(
            files,
            name=name,
            image_column=columns.image,
            caption_column=caption,
            extra_columns=columns.extras,
            image_id_column=columns.image_id,
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
        caption_role=columns.caption_role,
        image_id_column=columns.image_id,
        caption_flag=columns.caption_flag,
    )


def _data_file_splits(root: str) -> dict[str, list[str]]:
    """Group the data files under ``root`` into splits, by file-name prefix or folder name.

    The files are those of one format: parquet when there are any (``vlfit prepare``'s output, a cloned hub repo),
    else the one of jsonl, json, csv or tar shards the folder holds (two of those at once are refused).
    """
    by_extension: dict[str, list[str]] = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))  # skip caches and hidden folders
        for name in sorted(names):
            ext = os.path.splitext(name)[1].lower()
            if ext in SUPPORTED_FILE_EXTENSIONS and not name.startswith("."):
                by_extension.setdefault(ext, []).append(os.path.join(folder, name))
    if ".parquet" in by_extension:
        ext = ".parquet"
    elif not by_extension:
        return {}
    elif len(by_extension) > 1:
        raise DataError(
            f"{root}: holds data files of several formats ({', '.join(sorted(by_extension))}); keep one format per "
            "folder, or name the files of each split with --train_file / --validation_file / --test_file"
        )
    else:
        (ext,) = by_extension
    files = by_extension[ext]
    known: dict[str, list[str]] = {}
    unknown: list[str] = []
    for path in files:
        rel = os.path.relpath(path, root).split(os.sep)
        prefix = rel[-1][: -len(ext)].split("-")[0]
        folders = [d for d in reversed(rel[:-1]) if d in KNOWN_SPLIT_NAMES]
        split = prefix if prefix in KNOWN_SPLIT_NAMES else next(iter(folders), None)
        if split is None:
            unknown.append(path)
        else:
            known.setdefault(split, []).append(path)
    if not known:  # no split naming at all: everything is training data
        return {"train": files}
    for path in unknown:
        rel = os.path.relpath(path, root).split(os.sep)
        shard = _HUB_SHARD_NAME.match(rel[-1])
        split = shard.group("split") if shard else (rel[-2] if len(rel) > 1 else rel[-1][: -len(ext)])
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
    shard_reader: ShardReader | None = None,
) -> dict[str, ImageTextSource]:
    if is_stream_spec(dataset_name):  # shard URLs: one split, 'train', read from local copies
        files = spec_files(dataset_name, shard_reader, flag="--dataset_name")
        return {"train": _open_files("train", files, columns, cache_dir, of=dataset_name)}
    if _names_files(dataset_name):  # a file or a pattern of them: one split, 'train' (as datasets' builders do)
        return {"train": _open_files("train", resolve_files(dataset_name), columns, cache_dir)}
    root = os.path.join(dataset_name, data_dir) if data_dir and os.path.isdir(dataset_name) else dataset_name
    if os.path.isdir(root) and any(os.path.isfile(os.path.join(root, f)) for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(root)
        splits = {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
        return {s: _arrow_source(d, s, f"split {s!r} of {root}", columns) for s, d in splits.items()}
    if os.path.isdir(root):
        found = _data_file_splits(root)
        if found:  # image paths in jsonl/csv rows are relative to their file, as with train_file
            return {split: _open_files(split, files, columns, cache_dir, of=root) for split, files in found.items()}
    # A hub id, or a local folder that the datasets library knows how to read (for example a cloned hub repo).
    try:
        loaded = datasets.load_dataset(
            dataset_name, config_name, revision=revision, cache_dir=cache_dir, token=token, data_dir=data_dir
        )
    except (OSError, ValueError) as error:  # not found (locally or on the hub), offline, a wrong config name
        raise DataError(f"dataset {dataset_name!r}: cannot open it: {first_line(error, 300)}") from error
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if not isinstance(loaded, datasets.DatasetDict):
        raise DataError(f"{dataset_name}: expected a map-style DatasetDict, got {type(loaded).__name__}")
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
    caption_column: str | None = "image_description",
    id_column: str | None = None,
    extra_columns: Sequence[str] = (),
    caption_role: str = "caption",
    image_id_column: str | None = None,
    shard_reader: ShardReader | None = None,
    caption_flag: str | None = None,
) -> dict[str, ImageTextSource]:
    """Open every split of an image-text dataset as a map-style source.

    ``dataset_name`` may be a hub id, a local ``save_to_disk`` folder (a ``DatasetDict``, or a ``Dataset`` that
    becomes split ``train``), or a local folder of parquet files (splits from ``{split}-*.parquet`` names or
    ``{split}/`` folders; with no recognisable split names everything is ``train``). The ``*_file`` arguments
    take ``.parquet``, ``.jsonl``/``.json``, ``.csv`` or WebDataset ``.tar`` files: a path, a glob, ``{000..009}``
    braces, or a comma-separated list. In JSON lines and CSV files, image paths are relative to the file's folder.
    When both are given, the files replace (or add) their splits. A spec of shard URLs (``https://``, ``s3://``...,
    or ``::``-joined sources) is fetched to local copies first (``vlfit.data.stream.fetch``).

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
        image_column: Column holding the image (for tar shards: preferred image member extension). At its
            default, ``image``, the first of ``source_base.DEFAULT_COLUMNS["image"]`` present is read.
        caption_column: Column holding the caption (for tar shards: member extension or ``.json`` key); ``None``
            for images only (datasets, not tar shards: captions are then the sample ids). At its default,
            ``image_description``, the first of ``source_base.DEFAULT_COLUMNS["caption"]`` present is read.
        id_column: Column holding ids; by default ``instance_id`` or ``id`` when present, else ``"{split}-{row}"``.
        extra_columns: Columns copied into ``Record.extra`` when present (missing ones are left out).
        caption_role: What the caption column is called in error messages (``label`` for a class column).
        image_id_column: Column (tar shards: member or ``.json`` key) naming the image a row shows; rows with
            equal values are captions of one image. ``None``: rows are grouped by their image bytes.
        shard_reader: Retries and timeout of fetching shard URLs (default: ``ShardReader()``'s).
        caption_flag: The flag naming the caption column in error messages (default ``--{caption_role}_column``).

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
        raise DataError(
            "no data given: pass --dataset_name (a hub id, a save_to_disk folder or a folder of parquet files) "
            "or --train_file / --validation_file / --test_file (.parquet, .jsonl, .json, .csv or .tar)"
        )
    columns = _Columns(
        image_column, caption_column, id_column, tuple(extra_columns), caption_role, image_id_column, caption_flag
    )
    # Resolve every pattern first so a typo fails before any slow dataset loading.
    local = {split: resolve_files(spec) for split, spec in file_specs.items() if not is_stream_spec(spec)}
    for files in local.values():
        for path in files:
            _file_extension(path)
    streamed = {split: spec for split, spec in file_specs.items() if is_stream_spec(spec)}
    for split, spec in streamed.items():  # URLs: checked, then fetched once every local pattern is known good
        local[split] = spec_files(spec, shard_reader, flag=f"--{split}_file")
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
                shard_reader=shard_reader,
            )
        )
    for split in file_specs:
        sources[split] = _open_files(split, local[split], columns, cache_dir, of=streamed.get(split))
    return sources
