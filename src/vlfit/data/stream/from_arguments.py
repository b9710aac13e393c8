"""The training stream a run's flags describe: ``--train_file`` sources (or ``--dataset_name``'s data files with
``--streaming``), ``--train_data_weights``, ``--shuffle_buffer``, ``--resampled``, ``--shard_retries`` and
``--shard_timeout``, split over this run's processes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from vlfit.data.records import Record
from vlfit.data.stream.shards import ShardReader, ShardUnreadableError
from vlfit.data.stream.stream import ShardStream
from vlfit.data.stream.urls import parse_sources
from vlfit.data.tar_source import WebDatasetLayout
from vlfit.errors import ConfigError

logger = logging.getLogger(__name__)

# A preset's tokenizer is trained on the captions of the first shards: this many, at most.
TOKENIZER_CAPTIONS = 20_000


def shard_reader(data_args: Any, layout: WebDatasetLayout | None = None) -> ShardReader:
    """The ``ShardReader`` of ``--shard_retries`` and ``--shard_timeout`` (what fetching evaluation shards uses
    too), reading samples with ``layout``."""
    retries, timeout = int(data_args.shard_retries), float(data_args.shard_timeout)
    return ShardReader(layout or WebDatasetLayout(), retries=retries, timeout=timeout)


def open_train_stream(
    data_args: Any, *, seed: int, rank: int, world_size: int, extra_columns: tuple[str, ...] = ()
) -> ShardStream:
    """The training split as a ``ShardStream`` over this process's share of the shards.

    Args:
        data_args: ``vlfit.arguments.DataArguments`` (its location, column and stream flags).
        seed: Seeds the shard order and the shuffle (the same on every process).
        rank: This process.
        world_size: How many processes read the stream.
        extra_columns: Columns carried per sample (``--hard_negative_column``).

    Raises:
        ConfigError: for a spec, weights or settings the stream refuses, or for nothing to stream.
    """
    spec = data_args.train_file
    if not spec:
        raise ConfigError(
            "--streaming reads the training split from --train_file: tar shards as a path, glob, {000..099} "
            "pattern or URL, several sources joined by '::' (hub datasets: pass their shards' hf:// URLs)"
        )
    layout = WebDatasetLayout(
        image_column=data_args.image_column,
        caption_column=data_args.caption_column,
        extra_columns=tuple(extra_columns),
        image_id_column=data_args.image_id_column,
    )
    reader = shard_reader(data_args, layout)
    sources = parse_sources(spec, data_args.train_data_weights)
    for source in sources:
        not_tar = [url for url in source.urls if not url.lower().endswith(".tar")]
        if not_tar:
            raise ConfigError(
                f"--train_file: a stream reads WebDataset .tar shards; {not_tar[0]!r} (of {source.spec!r}) is not one "
                "(other local formats train map-style: drop --streaming)"
            )
    stream = ShardStream(
        sources,
        reader=reader,
        shuffle_buffer=int(data_args.shuffle_buffer),
        seed=seed,
        resampled=bool(data_args.resampled),
        rank=rank,
        world_size=world_size,
    )
    shards = sum(len(s.urls) for s in sources)
    logger.info(
        "streaming the training split: %d shard%s in %d source%s%s, shuffle buffer %d%s",
        shards, "s" * (shards != 1), len(sources), "s" * (len(sources) != 1),
        f" (weights {', '.join(f'{s.weight:g}' for s in sources)})" if len(sources) > 1 else "",
        stream.shuffle_buffer, ", resampled" if stream.resampled else "",
    )  # fmt: skip
    return stream


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
