"""Where a dataset's splits are, and what reads each: a hub id, a ``save_to_disk`` folder, a folder of data files
(splits from file or folder names), files named one by one or by pattern. ``vlfit.data.sources.openers`` calls these;
the sources themselves are ``ArrowSource`` (``arrow.py``) and ``TarSource`` (``tar.py``)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence

import datasets
from datasets.exceptions import DatasetGenerationError

from vlfit.data.columns import Columns
from vlfit.data.file_patterns import is_stream_spec, resolve_files
from vlfit.data.sources.arrow import ArrowSource
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.tar import TarSource
from vlfit.data.stream.fetch import spec_files
from vlfit.data.stream.shards import ShardReader
from vlfit.errors import ConfigError, DataError, first_line
from vlfit.models.reference import folder_kind

SUPPORTED_FILE_EXTENSIONS: tuple[str, ...] = (".parquet", ".jsonl", ".json", ".csv", ".tar")
_BUILDER_FOR_EXTENSION = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
_EMPTY_FILE_HINT = {
    "csv": "a header line naming the columns, then one line per sample",
    "json": "one JSON object per sample",
    "parquet": "a parquet table, as pandas' to_parquet or vlfit prepare write",
}
# Split names recognised in local parquet folders, from file-name prefixes (`train-*.parquet`) or folder names.
KNOWN_SPLIT_NAMES: tuple[str, ...] = ("train", "validation", "valid", "val", "dev", "test", "eval")
_HUB_SHARD_NAME = re.compile(r"^(?P<split>[\w.]+?)-\d+-of-\d+")


def file_extension(path: str) -> str:
    """The lower-cased extension of a data file (``DataError`` for one no source reads)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_FILE_EXTENSIONS:
        raise DataError(
            f"unsupported file {path!r}: extension {ext or '(none)'!r} is not one of {list(SUPPORTED_FILE_EXTENSIONS)}"
        )
    return ext


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
        for path in group:  # pandas' EmptyDataError would come as a traceback from datasets' builder
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                raise DataError(
                    f"{path}: the file is empty (0 bytes); write its rows into it ({_EMPTY_FILE_HINT[builder]}) "
                    "or leave it out of the data files"
                )
        try:
            part = datasets.load_dataset(builder, data_files=group, split="train", cache_dir=cache_dir)
        except (OSError, ValueError, DatasetGenerationError) as error:  # pyarrow's ArrowInvalid is a ValueError
            if not any(_has_rows(builder, path) for path in group):  # datasets: 'Instruction "train" corresponds ...'
                files = "the file has" if len(group) == 1 else "the files have"
                raise DataError(
                    f"{_describe(group)}: {files} no rows (a {builder} file is {_EMPTY_FILE_HINT[builder]}); write "
                    "its rows into it or leave it out of the data files"
                ) from error
            raise DataError(f"{_describe(group)}: cannot read it as {builder}: {first_line(error, 300)}") from error
        base_dirs.append((rows, folder))
        rows += len(part)
        parts.append(part)
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return dataset, base_dirs


def _has_rows(builder: str, path: str) -> bool:
    """Whether a data file holds a row (asked once reading it failed): a CSV line after its header, a JSON line, a
    parquet row. Only the first lines are read."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows > 0
        except (OSError, ValueError):
            return True  # not a parquet file: the reader's error says so
    header = 1 if builder == "csv" else 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = (line for line in f if line.strip())
        return next(itertools.islice(lines, header, None), None) is not None


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


def open_files(
    split: str, files: Sequence[str], columns: Columns, cache_dir: str | None, of: str | None = None
) -> ImageTextSource:
    """One split from its data files (one format: tar shards, or files a datasets builder reads); ``of`` names
    what they came from in messages (a folder, a URL spec)."""
    extensions = {file_extension(f) for f in files}
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
    columns: Columns,
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


def open_named(
    dataset_name: str,
    *,
    config_name: str | None,
    revision: str | None,
    data_dir: str | None,
    cache_dir: str | None,
    token: str | None,
    columns: Columns,
    shard_reader: ShardReader | None = None,
) -> dict[str, ImageTextSource]:
    """Every split of ``--dataset_name``: shard URLs (fetched), files or a pattern of them, a ``save_to_disk``
    folder, a folder of data files, or a hub id (or a folder the datasets library reads)."""
    if is_stream_spec(dataset_name):  # shard URLs: one split, 'train', read from local copies
        files = spec_files(dataset_name, shard_reader, flag="--dataset_name")
        return {"train": open_files("train", files, columns, cache_dir, of=dataset_name)}
    if _names_files(dataset_name):  # a file or a pattern of them: one split, 'train' (as datasets' builders do)
        return {"train": open_files("train", resolve_files(dataset_name), columns, cache_dir)}
    root = os.path.join(dataset_name, data_dir) if data_dir and os.path.isdir(dataset_name) else dataset_name
    if os.path.isdir(root) and any(os.path.isfile(os.path.join(root, f)) for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(root)
        splits = {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
        return {s: _arrow_source(d, s, f"split {s!r} of {root}", columns) for s, d in splits.items()}
    if os.path.isdir(root):
        kind = folder_kind(root)
        if kind.kind in ("model", "adapters", "export", "index", "run"):  # their .json files are no data
            raise ConfigError(f"--dataset_name {root}: {kind.what}, not a dataset{kind.use_after(': ')}")
        found = _data_file_splits(root)
        if found:  # image paths in jsonl/csv rows are relative to their file, as with train_file
            return {split: open_files(split, files, columns, cache_dir, of=root) for split, files in found.items()}
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
