"""Embedding a build's items into index shard files (``vlfit.index.build`` decides which, and where they go).

A build's shards are a ``ShardWork``: everything a process needs to write any of them (the source, the items of
each shard or its tar shard's URL, the first file number), so the processes that share a build (torchrun's ranks, a
cluster engine's tasks: ``vlfit.index.distribute``) each write the positions they are given. ``embed_rows`` embeds
items of a folder or dataset split, shard by shard, through one loader over all the positions given;
``embed_shards`` fetches tar shards at URLs one at a time beside the index (``FETCH_FOLDER``: the next while this one
is embedded, then deleted) and embeds each into one index shard. Each yields a ``ShardPart`` per shard
(``vlfit.index.transaction`` lists them in the manifest); an item whose image is bad, or a tar shard that cannot be
fetched or read, is a bad item of its part.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from vlfit.data.batch import Batch
from vlfit.data.image_groups import ImageItems, image_items
from vlfit.data.image_inputs import encoder_inputs
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.tar import ShardCollection, TarSource
from vlfit.errors import DataError, first_line
from vlfit.index.build_request import BuildRequest
from vlfit.index.store import write_shard
from vlfit.index.transaction import ShardPart
from vlfit.inference.backends import Encoder

FETCH_FOLDER = ".fetching"  # inside the index folder: the tar shards being embedded, one process's each


@dataclass(frozen=True)
class ShardWork:
    """The shards one build writes, and all a process needs to write any of them.

    Attributes:
        source: The images: a folder or dataset split (``items`` names its items), or tar shards at URLs.
        items: The items of a folder or split; None for tar shards at URLs.
        shards: Per shard, the positions in ``items`` of its items, or the URL of its tar shard.
        first_number: The file number of the first shard (shard ``p`` is file ``first_number + p``).
        storage: The shard files' format.
        request: The build (its folder, batch size, loader workers).
    """

    source: ImageTextSource | ShardCollection
    items: ImageItems | None
    shards: list[list[int]] | list[str]
    first_number: int
    storage: str
    request: BuildRequest

    def __len__(self) -> int:
        return len(self.shards)

    def sizes(self) -> list[int]:
        """Per shard, what a progress bar counts: its items, or 1 for a tar shard."""
        return [1 if isinstance(shard, str) else len(shard) for shard in self.shards]

    def embed(self, encoder: Encoder, positions: list[int], worker: int = 0) -> Iterator[ShardPart]:
        """Embed and write the shards at ``positions``, yielding a part per shard in that order; ``worker`` names
        the process's fetch folder (tar shards at URLs: one folder per process writing beside the index)."""
        if self.items is None:
            return embed_shards(encoder, self.source, self.shards, positions, self.first_number, self.storage,
                                self.request, worker)  # fmt: skip
        return embed_rows(encoder, self.source, self.items, self.shards, positions, self.first_number, self.storage,
                          self.request)  # fmt: skip


def _batches(encoder: Encoder, source: ImageTextSource, request: BuildRequest) -> Iterator[Batch]:
    """The host batches of ``source`` as ``encoder`` takes its images, ``request.batch_size`` at a time (the one
    loader of a build: items of a folder or split, and each tar shard's)."""
    return iter(host_batches(source, encoder.spec, batch_size=request.batch_size, num_workers=request.num_workers))


def _embed_batches(
    encoder: Encoder, batches: Iterator[Batch], to_item: Callable[[str], str], count: int | None = None
) -> tuple[list[str], list[torch.Tensor], list[dict[str, str]]]:
    """Item ids, embeddings and bad items of the next ``count`` batches (``None``: all that are left); ``to_item``
    names the item of a record id."""
    ids: list[str] = []
    parts: list[torch.Tensor] = []
    bad: list[dict[str, str]] = []
    for batch in batches if count is None else itertools.islice(batches, count):
        bad.extend({"id": to_item(b.id), "reason": b.reason} for b in batch.bad_samples)
        if len(batch):
            # A NaFlex model's batch carries its patches' mask and grids too.
            parts.append(encoder.encode_images(**encoder_inputs(batch.inputs)).float().cpu())
            ids.extend(to_item(sample_id) for sample_id in batch.sample_ids)
    return ids, parts, bad


def embed_rows(
    encoder: Encoder,
    source: ImageTextSource,
    items: ImageItems,
    shards: list[list[int]],
    mine: list[int],
    first_number: int,
    storage: str,
    request: BuildRequest,
) -> Iterator[ShardPart]:
    """The shards of items at positions ``mine``, each embedded into one index shard file, through one loader over
    all of them (an item's first record stands for its image)."""
    to_item = _item_of_record(items)
    selected = source.select([items.rows[item] for position in mine for item in shards[position]])
    batch_iter = _batches(encoder, selected, request)
    for position in mine:
        count = -(-len(shards[position]) // request.batch_size)
        ids, parts, bad = _embed_batches(encoder, batch_iter, to_item, count)
        number = first_number + position
        entry = _write_items(request.output_dir, number, ids, parts, storage, items) if ids else None
        yield ShardPart(position, entry, bad)


def _item_of_record(items: ImageItems) -> Callable[[str], str]:
    """The item id of a record id (of an item's first record: the one embedded)."""
    item_of = dict(zip(items.record_ids, items.ids, strict=True))
    return lambda record_id: item_of.get(record_id, record_id)


def _write_items(
    folder: str, number: int, ids: list[str], parts: list[torch.Tensor], storage: str, items: ImageItems
) -> dict[str, Any]:
    """``write_shard`` of embedded items, with their captions when the items have some."""
    captions = None
    if items.captions is not None:
        captions_of = dict(zip(items.ids, items.captions, strict=True))
        captions = [captions_of[item] for item in ids]
    return write_shard(folder, number, ids, torch.cat(parts), storage, captions)


def embed_shards(
    encoder: Encoder,
    shards: ShardCollection,
    todo: list[str],
    mine: list[int],
    first_number: int,
    storage: str,
    request: BuildRequest,
    worker: int,
) -> Iterator[ShardPart]:
    """The tar shards of ``todo`` at positions ``mine``, each fetched to a local copy in the fetch folder of process
    ``worker`` (the next one while this one is embedded), embedded into one index shard file, and deleted. A shard
    that cannot be fetched or read is a bad item named by its URL."""
    from vlfit.data.stream import ShardUnreadableError

    reader = shards.reader()
    folder = os.path.join(request.output_dir, FETCH_FOLDER, f"rank-{worker:05d}")
    os.makedirs(folder, exist_ok=True)

    def fetch(position: int) -> str:
        path = os.path.join(folder, f"{position:05d}.tar")
        reader.copy_to(todo[position], path)
        return path

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(fetch, mine[0]) if mine else None
        for number, position in enumerate(mine):
            url, fetching = todo[position], pending
            pending = pool.submit(fetch, mine[number + 1]) if number + 1 < len(mine) else None
            path = None
            try:
                path = fetching.result()
                layout = shards.layout
                tar = TarSource(
                    [path],
                    name=f"shard {url}",
                    image_column=layout.image_column,
                    caption_column=layout.caption_column,
                    image_id_column=layout.image_id_column,
                )
                items = image_items(tar)  # the images of this tar shard (one shard's captions are grouped)
                selected = tar.select(items.rows)
                batches = _batches(encoder, selected, request)
                ids, parts, bad = _embed_batches(encoder, batches, _item_of_record(items))
            except (ShardUnreadableError, DataError) as err:
                yield ShardPart(position, None, [{"id": url, "reason": f"shard not indexed: {first_line(err, 300)}"}])
                continue
            finally:
                if path is not None and os.path.exists(path):
                    os.remove(path)
            entry = None
            if ids:
                written = _write_items(request.output_dir, first_number + position, ids, parts, storage, items)
                entry = {**written, "source": url}
            yield ShardPart(position, entry, bad)
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(folder))  # the last process out removes the fetch folder


__all__ = ["FETCH_FOLDER", "ShardWork", "embed_rows", "embed_shards"]
