"""Streaming WebDataset tar shards from fsspec URLs (``https://``, ``s3://``, local paths...): no download first.

- ``urls``: source specs (``a/{000..099}.tar::b/{000..009}.tar``) and per-source weights.
- ``shards``: one shard read front to back into records, with retries; a shard that stays unreadable is a
  ``BadShard``.

Needs the ``stream`` extra for HTTP(S) (``pip install 'vlfit[stream]'``).
"""

from vlfit.data.stream.shards import BadShard, ShardReader, ShardUnreadableError
from vlfit.data.stream.urls import StreamSource, parse_sources, parse_weights

__all__ = ["BadShard", "ShardReader", "ShardUnreadableError", "StreamSource", "parse_sources", "parse_weights"]
