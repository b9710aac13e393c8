"""The streamed training split of a run: ``--train_file`` sources (or ``--dataset_name``'s data files with
``--streaming``: a hub dataset's parquet files), mixed by ``--train_data_weights``, shuffled through
``--shuffle_buffer``, ``--resampled`` or not, read with the location's ``ShardReader`` (retries, timeout, storage
options) and split over the run's processes; and the checks and captions a run takes from it before training."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from vlfit.data.columns import DEFAULT_COLUMNS
from vlfit.data.records import Record
from vlfit.data.stream.parquet_rows import is_parquet
from vlfit.data.stream.shards import ShardReader, ShardUnreadableError, describe_fault, is_unreachable
from vlfit.data.stream.stream import ShardStream
from vlfit.data.stream.urls import StreamSource, parse_sources
from vlfit.data.webdataset import WebDatasetLayout
from vlfit.errors import ConfigError, DataError, UserError, first_line

logger = logging.getLogger(__name__)

# A preset's tokenizer is trained on the captions of the first shards: this many, at most.
TOKENIZER_CAPTIONS = 20_000


@dataclass(frozen=True)
class StreamSettings:
    """How a streamed training split is mixed, shuffled and split over a run's processes.

    Attributes:
        weights: ``--train_data_weights``: comma-separated weights of ``--train_file``'s ``::`` sources.
        shuffle_buffer: Samples each loader worker's shuffle buffer holds (0: shard order).
        resampled: Draw shards with replacement, endlessly.
        seed: Seeds the shard order and the shuffle (the same on every process).
        rank: This process.
        world_size: How many processes read the stream.
    """

    weights: str | None = None
    shuffle_buffer: int = 1000
    resampled: bool = False
    seed: int = 0
    rank: int = 0
    world_size: int = 1


def open_train_stream(
    location: Mapping[str, Any],
    settings: StreamSettings,
    *,
    extra_columns: tuple[str, ...] = (),
    token: str | None = None,
    cache_dir: str | None = None,
) -> ShardStream:
    """The training split as a ``ShardStream`` over this process's share of the shards.

    The shards are ``--train_file``'s (tar or parquet files: paths, patterns, URLs, ``::`` sources), or with
    ``--streaming --dataset_name`` the data files of the dataset's training split: a hub id's (``hf://`` URLs,
    read with ``token``) or a local folder's, as ``datasets.load_dataset_builder`` resolves them.

    Args:
        location: Where the data is and its columns, as ``vlfit.data.sources.openers.open_splits``'s keywords
            (``train_file``, ``dataset_name`` and its config, revision and ``data_dir``, ``image_column``,
            ``caption_column``, ``image_id_column``, ``shard_reader``).
        settings: Mixing, shuffling and this process's share.
        extra_columns: Columns carried per sample (``--hard_negative_column``).
        token: Hub access token (``--token``), for a hub dataset's files.
        cache_dir: Where the datasets library caches what it resolves (``--cache_dir``).

    Raises:
        ConfigError: for a spec, weights or settings the stream refuses, or for nothing to stream.
    """
    layout = WebDatasetLayout(
        image_column=location.get("image_column", "image"),
        caption_column=location.get("caption_column") or DEFAULT_COLUMNS["caption"][0],
        extra_columns=tuple(extra_columns),
        image_id_column=location.get("image_id_column"),
    )
    train_file, dataset_name = location.get("train_file"), location.get("dataset_name")
    if train_file:
        sources = parse_sources(train_file, settings.weights)
        flag = "--train_file"
    elif dataset_name:
        if settings.weights is not None:
            raise ConfigError("--train_data_weights weights the '::' sources of --train_file; a dataset is one source")
        files = dataset_split_files(location, token=token, cache_dir=cache_dir)
        sources = [StreamSource(tuple(files), 1.0, dataset_name)]
        flag = "--dataset_name"
    else:
        raise ConfigError(
            "--streaming reads the training split from --train_file (tar or parquet shards as a path, glob, "
            "{000..099} pattern or URL, several sources joined by '::') or from --dataset_name's data files"
        )
    for source in sources:
        unknown = [url for url in source.urls if not (url.lower().endswith(".tar") or is_parquet(url))]
        if unknown:
            raise ConfigError(
                f"{flag}: a stream reads WebDataset .tar or .parquet shards; {unknown[0]!r} (of {source.spec!r}) is "
                "neither (other formats train map-style: drop --streaming)"
            )
    hub = {"token": token} if token and any(url.startswith("hf://") for s in sources for url in s.urls) else {}
    reader = replace(location.get("shard_reader") or ShardReader(), layout=layout)
    reader = replace(reader, storage_options={**hub, **reader.storage_options})
    stream = ShardStream(
        sources,
        reader=reader,
        shuffle_buffer=int(settings.shuffle_buffer),
        seed=settings.seed,
        resampled=bool(settings.resampled),
        rank=settings.rank,
        world_size=settings.world_size,
    )
    shards = sum(len(s.urls) for s in sources)
    logger.info(
        "streaming the training split: %d shard%s in %d source%s%s, shuffle buffer %d%s",
        shards, "s" * (shards != 1), len(sources), "s" * (len(sources) != 1),
        f" (weights {', '.join(f'{s.weight:g}' for s in sources)})" if len(sources) > 1 else "",
        stream.shuffle_buffer, ", resampled" if stream.resampled else "",
    )  # fmt: skip
    return stream


def dataset_split_files(
    location: Mapping[str, Any], split: str = "train", *, token: str | None = None, cache_dir: str | None = None
) -> list[str]:
    """The data files of a split of the location's ``--dataset_name`` (at its ``--dataset_config_name``,
    ``--dataset_revision`` and ``--data_dir``), as ``datasets.load_dataset_builder`` resolves them (a hub id:
    ``hf://`` URLs at the revision; a local folder: its files by split name).

    Raises:
        ConfigError: when the dataset cannot be resolved or has no files for ``split`` (naming its splits).
    """
    import datasets

    name = location["dataset_name"]
    if os.path.isdir(name) and any(os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")):
        raise ConfigError(
            f"--dataset_name {name}: a save_to_disk folder (Arrow files) is not streamed; train on it map-style "
            "(drop --streaming), or stream its parquet or tar shards"
        )
    try:
        builder = datasets.load_dataset_builder(
            name,
            location.get("dataset_config_name"),
            revision=location.get("dataset_revision"),
            data_dir=location.get("data_dir"),
            token=token,
            cache_dir=cache_dir,
        )
    except (OSError, ValueError) as error:  # not found (locally or on the hub), offline, a wrong config name
        raise ConfigError(
            f"--dataset_name {name!r}: cannot resolve its data files: {first_line(error, 300)}"
        ) from error
    data_files = builder.config.data_files or {}
    files = list(data_files.get(split) or [])
    if not files:
        raise ConfigError(
            f"--dataset_name {name!r}: no data files of split {split!r} (its splits: "
            f"{', '.join(data_files) or 'none'}); name the files with --{split}_file"
        )
    return files


def check_reachable(stream: ShardStream) -> None:
    """Open the first shard of every source, so that a server that cannot be reached at all is named in one line
    before anything else runs (a preset's tokenizer would otherwise be trained on no captions). Transient faults
    are retried as a shard read retries them; an answer that is an error (a 404...) is left to the stream, which
    judges lost shards as they come.

    Raises:
        DataError: naming the source and the URL its server could not be reached at.
    """
    reader = stream.reader
    for source in stream.sources:
        url, failures = source.urls[0], 0
        while True:
            try:
                with reader.open(url) as file:
                    file.read(1)
                break
            except UserError:
                raise
            except Exception as err:  # noqa: BLE001 - judged by is_unreachable; the stream reports the others
                if not is_unreachable(err):
                    break
                failures += 1
                try:
                    reader.retry_or_give_up(url, err, failures, 0)
                except ShardUnreadableError:
                    raise DataError(
                        f"{stream_flag(source)}: cannot reach the server of {url} ({describe_fault(err)}); check "
                        "that it is running and the URL, then run again"
                    ) from None


def stream_flag(source: StreamSource) -> str:
    """How a source is named in messages: its spec as written."""
    return f"source {source.spec!r}" if source.spec else "the stream"


def first_captions(stream: ShardStream, limit: int = TOKENIZER_CAPTIONS) -> list[str | None]:
    """Captions of the first shards of every source, in spec order, up to ``limit`` in all (for training a preset's
    tokenizer; every process reads the same ones, so every process trains the same tokenizer). A shard that cannot
    be read is passed over."""
    per_source = max(1, limit // len(stream.sources))
    captions: list[str | None] = []
    for source in stream.sources:
        records = itertools.islice(_records(stream.reader, source.urls), per_source)
        captions.extend(record.caption for record in records)
    return captions


def _records(reader: ShardReader, urls: tuple[str, ...]) -> Iterator[Record]:
    for url in urls:
        try:
            for _, record in reader.samples(url):
                if isinstance(record, Record):
                    yield record
        except ShardUnreadableError as err:
            logger.warning("tokenizer captions: %s", err)


def streamed_eval_files(
    location: Mapping[str, Any], split: str, *, token: str | None, cache_dir: str | None
) -> dict[str, str]:
    """``--streaming --dataset_name``: the evaluation split's data files as ``validation_file`` or ``test_file``
    (given ones kept), a spec of local paths or, for a hub dataset, of URLs read from local copies."""
    if split not in ("validation", "test"):
        raise ConfigError(
            f"--streaming --dataset_name evaluates the dataset's 'validation' or 'test' split, not {split!r}; "
            "set --eval_split, or name the files with --validation_file"
        )
    if location.get(f"{split}_file"):
        return {}
    files = dataset_split_files(location, split, token=token, cache_dir=cache_dir)
    return {f"{split}_file": ("::" if any("://" in f for f in files) else ",").join(files)}
