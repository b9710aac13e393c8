"""Streaming WebDataset tar shards from fsspec URLs (``https://``, ``s3://``, local paths...): no download first.

- ``urls``: source specs (``a/{000..099}.tar::b/{000..009}.tar``) and per-source weights.
- ``shards``: one shard read front to back into records, with retries; a shard that stays unreadable is a
  ``BadShard``.
- ``order``: which shards each rank and worker reads, in which order, and the weighted choice of sources.
- ``worker``: one reader's interleave of its sources through a shuffle buffer, and its exact resume.
- ``state``: the position every item carries, of which the resume state is made.
- ``stream``: ``ShardStream``, the ``IterableDataset`` (and how its state reaches the main process).

Needs the ``stream`` extra for HTTP(S) (``pip install 'vlfit[stream]'``).
"""

from vlfit.data.stream.shards import BadShard, ShardReader, ShardUnreadableError, SourceUnreachableError
from vlfit.data.stream.state import StreamItem, WorkerPosition, WorkerState
from vlfit.data.stream.stream import ShardStream
from vlfit.data.stream.urls import StreamSource, parse_sources, parse_weights

__all__ = [
    "BadShard",
    "ShardReader",
    "ShardStream",
    "ShardUnreadableError",
    "SourceUnreachableError",
    "StreamItem",
    "StreamSource",
    "WorkerPosition",
    "WorkerState",
    "parse_sources",
    "parse_weights",
]
