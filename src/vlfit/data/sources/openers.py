"""The one way into data: every opener of a dataset, a collection or a run's data.

- ``open_splits`` / ``open_split``: the splits of a dataset (hub id, ``save_to_disk`` folder, folder of data
  files, ``.parquet``/``.jsonl``/``.json``/``.csv``/``.tar`` files, shard URLs fetched to local copies) as map-style
  sources (``ArrowSource``, ``TarSource``), for training, evaluation, ``prepare``, ``bench``, ``fewshot``, export.
- ``open_collection``: what an index embeds (``retrieve index``, ``vlfit.Index.build``, ``serve``): an image folder,
  a dataset split, or tar shards at URLs (``ShardCollection``).
- ``labelled_splits`` / ``open_zeroshot_sets``: a dataset's splits with a class column (``vlfit fewshot``), and
  the sets classified zero-shot while fine-tuning.
- ``open_run_data``: everything a training or evaluation run reads (``RunData``): the training split (map-style,
  or a ``ShardStream``), the evaluation split and the zero-shot sets, checked before any model loads.

The column and location flags arrive as keywords (``open_splits``'s; the CLI's dataclasses convert at the edge).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlfit.data.columns import DEFAULT_COLUMNS
from vlfit.data.file_patterns import is_stream_spec, resolve_files
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.images import ImageFolderSource
from vlfit.data.sources.labelled import (
    DEFAULT_TEMPLATES,
    ZEROSHOT_FLAGS,
    LabelledSplit,
    ZeroShotSet,
    check_templates,
    label_splits,
    zeroshot_names,
)
from vlfit.data.sources.locations import Columns, file_extension, open_files, open_named
from vlfit.data.sources.tar import ShardCollection
from vlfit.data.stream.fetch import spec_files
from vlfit.data.stream.shards import ShardReader
from vlfit.data.stream.stream import ShardStream
from vlfit.data.stream.train_stream import (
    StreamSettings,
    check_reachable,
    first_captions,
    open_train_stream,
    streamed_eval_files,
)
from vlfit.data.stream.urls import parse_sources
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.errors import ConfigError, DataError


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
            default, ``image``, the first of ``vlfit.data.columns.DEFAULT_COLUMNS["image"]`` present is read.
        caption_column: Column holding the caption (for tar shards: member extension or ``.json`` key); ``None``
            for images only (datasets, not tar shards: captions are then the sample ids). At its default,
            ``image_description``, the first of ``vlfit.data.columns.DEFAULT_COLUMNS["caption"]`` present is read.
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
    columns = Columns(
        image_column, caption_column, id_column, tuple(extra_columns), caption_role, image_id_column, caption_flag
    )
    # Resolve every pattern first so a typo fails before any slow dataset loading.
    local = {split: resolve_files(spec) for split, spec in file_specs.items() if not is_stream_spec(spec)}
    for files in local.values():
        for path in files:
            file_extension(path)
    streamed = {split: spec for split, spec in file_specs.items() if is_stream_spec(spec)}
    for split, spec in streamed.items():  # URLs: checked, then fetched once every local pattern is known good
        local[split] = spec_files(spec, shard_reader, flag=f"--{split}_file")
    sources: dict[str, ImageTextSource] = {}
    if dataset_name:
        sources.update(
            open_named(
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
        sources[split] = open_files(split, local[split], columns, cache_dir, of=streamed.get(split))
    return sources


def open_split(dataset_name: str, split: str, **keywords: Any) -> ImageTextSource:
    """One split of a dataset (hub id, ``save_to_disk`` folder, parquet folder, files), as ``vlfit train`` opens it.

    Args:
        dataset_name: The dataset.
        split: The split.
        keywords: More ``open_splits`` keywords (``image_column``, ``caption_column``, ``caption_role``: what the
            caption column is called in messages, ``label`` when it holds classes; ``image_id_column``...).

    Raises:
        DataError: when the split does not exist (naming the dataset's splits).
    """
    opened = open_splits(dataset_name=dataset_name, **keywords)
    if split not in opened:
        raise DataError(f"{dataset_name} has no split {split!r}; its splits: {', '.join(opened)}")
    return opened[split]


# What an index records of the collection it embedded (``open_collection``'s arguments), per build.
COLLECTION_KEYS = ("images", "dataset_name", "split", "image_column", "caption_column", "image_id_column")


def open_collection(
    *,
    images: str | None = None,
    dataset_name: str | None = None,
    split: str = "test",
    image_column: str = "image",
    caption_column: str | None = "image_description",
    image_id_column: str | None = None,
) -> tuple[ImageTextSource | ShardCollection, dict[str, Any]]:
    """What an index embeds: a folder of image files, a split of a dataset, or tar shards at URLs (a
    ``ShardCollection``; ``split`` does not apply); and how to open it again. ``image_id_column`` names the image
    a dataset row shows (rows of one image are one item; without it, rows with identical bytes are).

    Returns:
        The source, and its description for the index manifest (``COLLECTION_KEYS``; passed back as keyword
        arguments, it opens the same collection: what appending to an index does).

    Raises:
        ConfigError: unless exactly one of ``images`` and ``dataset_name`` is given.
    """
    if (images is None) == (dataset_name is None):
        raise ConfigError("pass exactly one of --images (a folder of image files) or --dataset_name")
    if images is not None:
        if image_id_column is not None:
            raise ConfigError(
                "--image_id_column names a column of --dataset_name; an image folder's files are its items"
            )
        return ImageFolderSource(images), {"images": os.path.abspath(images)}
    collection = {"dataset_name": dataset_name, "image_column": image_column, "caption_column": caption_column,
                  "image_id_column": image_id_column}  # fmt: skip
    if is_stream_spec(dataset_name):
        urls = tuple(url for part in parse_sources(dataset_name, flag="--dataset_name") for url in part.urls)
        layout = WebDatasetLayout(
            image_column=image_column,
            caption_column=caption_column or DEFAULT_COLUMNS["caption"][0],  # unset: the common caption members
            image_id_column=image_id_column,
        )
        return ShardCollection(dataset_name, urls, layout), {**collection, "streamed": True}
    source = open_split(
        dataset_name, split, image_column=image_column, caption_column=caption_column, image_id_column=image_id_column
    )
    return source, {"dataset_name": dataset_name, "split": split, **collection}


@dataclass
class RunData:
    """What a training or evaluation run reads.

    Attributes:
        train: The training split, map-style (``None`` without training, or when it is streamed).
        train_stream: The training split when it is streamed.
        eval: The evaluation split (``None`` without evaluation).
        zeroshot: The labelled splits every evaluation classifies zero-shot.
        captions: The captions a preset's tokenizer is trained on, read when called (the training split's, else
            the dataset's ``train`` split's, else the evaluation split's; a stream's first shards'), or ``None``.
    """

    train: ImageTextSource | None = None
    train_stream: ShardStream | None = None
    eval: ImageTextSource | None = None
    zeroshot: list[ZeroShotSet] = field(default_factory=list)
    captions: Callable[[], Sequence[str | None]] | None = None


def open_run_data(
    location: Mapping[str, Any],
    *,
    train: bool,
    evaluate: bool,
    streaming: bool = False,
    stream: StreamSettings = StreamSettings(),
    eval_split: str = "validation",
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    hard_negative_column: str | None = None,
    extra_columns: Sequence[str] = (),
    zeroshot_datasets: Sequence[str] = (),
    zeroshot_label_column: str = "label",
    zeroshot_split: str = "test",
    prompt_templates: Sequence[str] | None = None,
    cache_dir: str | None = None,
    token: str | None = None,
) -> RunData:
    """Open everything a run reads, checked before any model loads.

    The training split is streamed with ``streaming`` or a ``train_file`` of shard URLs (its shards' server must
    answer now); evaluation's splits then open map-style (URLs: local copies), and a streamed ``dataset_name`` is
    never loaded whole: evaluation opens its split's own data files.

    Args:
        location: Where the data is and its columns: ``open_splits``'s keywords (``dataset_name``, the ``*_file``
            specs, ``image_column``, ``caption_column``, ``id_column``, ``image_id_column``, ``shard_reader``...).
        train: Whether the run trains (``--do_train``).
        evaluate: Whether it evaluates (``--do_eval``).
        streaming: Stream the training split (``--streaming``).
        stream: How a streamed split is mixed, shuffled and split over processes.
        eval_split: The split evaluation reads.
        max_train_samples: Keep the training split's first N samples.
        max_eval_samples: Keep the evaluation split's first N samples.
        hard_negative_column: A column of alternative captions the training split must have.
        extra_columns: More columns the records carry where present (``--task vqa``'s answers).
        zeroshot_datasets: Labelled datasets to classify zero-shot at every evaluation.
        zeroshot_label_column: Their class column.
        zeroshot_split: Their split.
        prompt_templates: Their prompts (``None``: ``DEFAULT_TEMPLATES``).
        cache_dir: Where the datasets library caches downloads (``--cache_dir``).
        token: Hub access token (``--token``).

    Raises:
        ConfigError: for a split that is not there, a missing hard-negative column, zero-shot sets without
            evaluation, or a stream it refuses.
        DataError: for a split of fewer than 2 samples, or data that cannot be read.
    """
    requested = tuple(extra_columns)
    extra_columns = tuple(dict.fromkeys([*EVAL_COLUMNS, *filter(None, [hard_negative_column]), *requested]))
    streams = bool(streaming or is_stream_spec(location.get("train_file")))
    data = RunData()
    if train and streams:
        extra = tuple(dict.fromkeys([*filter(None, [hard_negative_column]), *requested]))
        data.train_stream = open_train_stream(location, stream, extra_columns=extra, token=token, cache_dir=cache_dir)
        check_reachable(data.train_stream)  # a dead server in one line, before a tokenizer is trained on nothing
    location = dict(location)
    train_file = location.get("train_file")
    if streams:
        location["train_file"] = None  # a stream's spec; evaluation's splits open map-style (URLs: local copies)
    if streaming and not train_file and location.get("dataset_name"):
        if evaluate:
            location.update(streamed_eval_files(location, eval_split, token=token, cache_dir=cache_dir))
        location["dataset_name"] = None
    has_splits = any(location.get(k) for k in ("dataset_name", "validation_file", "test_file"))
    splits = {}
    if has_splits or data.train_stream is None:
        splits = open_splits(**location, cache_dir=cache_dir, token=token, extra_columns=extra_columns)
    if train and data.train_stream is None:
        data.train = _limit(_require_split(splits, "train", "--do_train"), max_train_samples)
        if hard_negative_column is not None and hard_negative_column not in data.train.column_names:
            raise ConfigError(
                f"--hard_negative_column {hard_negative_column!r} is not a column of the training split; it has: "
                f"{', '.join(data.train.column_names)}"
            )
    if evaluate:
        data.eval = _limit(_require_split(splits, eval_split, "--do_eval"), max_eval_samples)
    for source, what in ((data.train, "training"), (data.eval, "evaluation")):
        if source is not None and len(source) < 2:
            raise DataError(
                f"the {what} split ({source.name}) has {len(source)} sample{'s' if len(source) != 1 else ''}: "
                "contrastive training and retrieval need at least 2 (with one, every loss is 0 and every recall 1)"
            )
    caption_source = data.train or splits.get("train") or data.eval
    if data.train_stream is not None:
        train_stream = data.train_stream
        data.captions = lambda: first_captions(train_stream)
    elif caption_source is not None:
        data.captions = caption_source.captions
    if zeroshot_datasets:
        if not evaluate:
            raise ConfigError("--zeroshot_dataset is scored at every evaluation: add --do_eval (or an --eval_strategy)")
        data.zeroshot = open_zeroshot_sets(
            zeroshot_datasets,
            label_column=zeroshot_label_column,
            split=zeroshot_split,
            image_column=location.get("image_column", "image"),
            templates=prompt_templates or DEFAULT_TEMPLATES,
        )
    return data


def _limit(source: ImageTextSource, max_samples: int | None) -> ImageTextSource:
    if max_samples is None or max_samples >= len(source):
        return source
    return source.select(range(max_samples))


def _require_split(splits: dict[str, ImageTextSource], name: str, flag: str) -> ImageTextSource:
    if name not in splits:
        raise ConfigError(f"{flag} needs a {name!r} split; the data has: {', '.join(splits) or 'none'}")
    return splits[name]


def labelled_splits(
    dataset_name: str | None = None,
    *,
    train_split: str,
    eval_split: str,
    label_column: str,
    image_column: str = "image",
    image_id_column: str | None = None,
    data: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> tuple[LabelledSplit, LabelledSplit]:
    """The split the shots come from and the split accuracy is measured on, each with one row per image
    (``LabelledSplit.per_image``: rows of one ``image_id_column`` value, or of identical bytes, are one image).

    The classes are those of the training split, in the order of a ``ClassLabel`` column's names (sorted for a
    text column).

    Args:
        dataset_name: The dataset, in any form ``open_splits`` opens.
        train_split: The split the shots come from.
        eval_split: The split accuracy is measured on (may be ``train_split``).
        label_column: The class column.
        image_column: The image column.
        image_id_column: The column naming the image a row shows (``--image_id_column``); None: identical bytes.
        data: More ``open_splits`` keyword arguments: ``train_file``, ``validation_file``, ``test_file`` (splits
            ``train``, ``validation``, ``test``), ``dataset_config_name``, ``data_dir``, ``cache_dir``...
        flags: The flags that name the label column and the two splits in error messages (keys ``label``,
            ``train_split``, ``eval_split``; defaults ``--label_column``, ``--train_split``, ``--eval_split``).

    Raises:
        DataError: naming the flag, when the label column or a split does not exist, a row has no label, the
            training split holds fewer than two classes, or the evaluation split holds a class the training split
            lacks, or rows of one image disagree on its class.
    """
    flags = {"label": "--label_column", "train_split": "--train_split", "eval_split": "--eval_split", **(flags or {})}
    label_flag = flags["label"]
    opened = open_splits(
        dataset_name=dataset_name,
        **(data or {}),
        image_column=image_column,
        image_id_column=image_id_column,
        caption_column=label_column,
        caption_role="label",
        caption_flag=label_flag,
    )
    for split, flag in ((train_split, flags["train_split"]), (eval_split, flags["eval_split"])):
        if split not in opened:
            given = dataset_name or "the data files given"
            raise DataError(f"{given} has no split {split!r}; its splits: {', '.join(opened)}. Pick one with {flag}")
    train, evaluation = label_splits(
        opened[train_split], opened[eval_split], train_split=train_split, eval_split=eval_split,
        label_column=label_column, label_flag=label_flag,
    )  # fmt: skip
    train = train.per_image()
    return train, train if eval_split == train_split else evaluation.per_image()


def open_zeroshot_sets(
    dataset_names: Sequence[str],
    *,
    label_column: str,
    split: str,
    image_column: str = "image",
    templates: Sequence[str] = DEFAULT_TEMPLATES,
) -> list[ZeroShotSet]:
    """One ``ZeroShotSet`` per dataset (any data source form); the classes are those of ``split``'s label column.

    Raises:
        ConfigError: for a bad template, or two datasets whose names would give the same metric names.
    """
    check_templates(templates)
    sets = []
    for dataset, name in zip(dataset_names, zeroshot_names(dataset_names), strict=True):
        labelled, _ = labelled_splits(
            dataset, train_split=split, eval_split=split, label_column=label_column, image_column=image_column,
            flags=ZEROSHOT_FLAGS,
        )  # fmt: skip
        sets.append(ZeroShotSet(name, labelled, tuple(templates)))
    return sets
