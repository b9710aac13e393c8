"""Streamed shards copied to local disk, for the readers that need every sample at hand by position: evaluation
splits (``--validation_file``/``--test_file``), ``vlfit prepare``, and a ``--dataset_name`` of shard URLs.

A training stream reads its shards front to back and never needs more than a buffer of them. Evaluation draws its
pools and groups captions by image over the whole split, and preparing or indexing a split reads it by row, so
those open shard URLs as map-style ``TarSource``s over local copies: each shard is fetched once (several at a time,
each through ``ShardReader``'s retries, backoff and per-read timeout) into a private temporary folder that is
removed when the process exits. A shard that stays unreadable is an error naming its URL: an evaluation split with
a shard missing would report numbers of a different set.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from vlfit.data.file_patterns import is_stream_spec, resolve_files
from vlfit.data.stream.shards import ShardReader
from vlfit.data.stream.urls import parse_sources, protocol

FETCH_THREADS = 4  # shards copied at once: enough to hide one connection's latency, few enough for any server


def _private_folder() -> str:
    """A new temporary folder, removed when this process exits (not when a forked loader worker does)."""
    folder = tempfile.mkdtemp(prefix="vlfit-shards-")
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    return folder


def local_name(number: int, url: str) -> str:
    """The local file name of the ``number``-th shard of a spec: its position, then the URL's own file name
    (positions keep two sources' ``000.tar`` apart; the name keeps a message about the copy recognisable)."""
    base = os.path.basename(urlsplit(url).path) if protocol(url) != "file" else os.path.basename(url)
    return f"{number:05d}-{base or 'shard.tar'}"


def fetch_shards(
    urls: Sequence[str],
    reader: ShardReader | None = None,
    folder: str | None = None,
    *,
    threads: int = FETCH_THREADS,
) -> list[str]:
    """Copy shards to local files, ``threads`` at a time.

    Args:
        urls: The shards (fsspec URLs or local paths).
        reader: Retries, timeout and storage options (default ``ShardReader()``).
        folder: Where the copies go (default: a private temporary folder removed at exit).
        threads: Shards copied at once.

    Returns:
        The local paths, in the order of ``urls``.

    Raises:
        ShardUnreadableError: for the first shard (in ``urls`` order) that could not be copied after its retries.
    """
    reader = reader or ShardReader()
    folder = folder or _private_folder()
    paths = [os.path.join(folder, local_name(number, url)) for number, url in enumerate(urls)]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        copies = [pool.submit(reader.copy_to, url, path) for url, path in zip(urls, paths, strict=True)]
        for copy in copies:
            copy.result()
    return paths


def spec_files(spec: str, reader: ShardReader | None = None, *, flag: str) -> list[str]:
    """The local files of a file spec: a local spec's paths as they are; a stream spec's shards (URLs, ``::``
    sources, read in the order written) fetched to local copies.

    Raises:
        MissingFileError: for a local pattern that matches nothing.
        ShardUnreadableError: for a shard that could not be fetched.
    """
    if not is_stream_spec(spec):
        return resolve_files(spec)
    urls = [url for source in parse_sources(spec, flag=flag) for url in source.urls]
    return fetch_shards(urls, reader)


__all__ = ["FETCH_THREADS", "fetch_shards", "local_name", "spec_files"]
