"""Building an index: embedding a collection's items into shards of the store (``vlfit.index.store``).

An item is one image. An image folder's items are its files, each id the file's absolute path. A dataset split's (or
tar shard's) records that show one image (one ``--image_id_column`` value, one row of a list caption column, or
identical bytes: ``vlfit.data.image_groups``, as evaluation groups them) are one item: embedded once, its id the
image id or else its first record's id, and its captions all of theirs (``captions`` of the shard's manifest entry;
an index built before items had captions has none).

A build (``BuildRequest``: the folder, what the collection is, batch and shard sizes, the processes) embeds, in
collection order, every item whose id is not in the index yet (nor listed as bad), and writes a shard each
``shard_size`` items, the manifest after it: an interrupted build resumes at the first unwritten shard with the same
batches, so its index equals one built in one go, and running it again over a folder that gained images appends
them. Tar shards at URLs (``ShardCollection``) are indexed a tar shard at a time, each into one index shard whose
manifest entry names it (``source``): a resumed or repeated build fetches only the tar shards not listed (one given
up earlier is tried again), and the disk holds two tar shards per process, not the set. Under torchrun each process
embeds its share of the shards and rank 0 lists them in order.

A build over an existing index first checks its shards (``vlfit.index.verify``, ``verify`` of the request), so
running the build again is how a damaged index is repaired. A shard with a damaged file (missing, cut short, another
checksum) whose ids file is whole and whose items the collection still holds is embedded again in its place: its
rows, and those after it, stay where they were (a server's item ids are rows). Otherwise (its ids damaged, or an
item gone) it is taken off the manifest and its items are embedded again into new shards at the end, and a warning
says that the rows after it moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from vlfit.data.image_groups import ImageItems, image_items
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.openers import COLLECTION_KEYS
from vlfit.data.sources.tar import ShardCollection
from vlfit.errors import ConfigError, DataError
from vlfit.index.build_request import BuildRequest, BuiltIndex
from vlfit.index.distribute import Distributor, TorchRanks
from vlfit.index.manifest import IndexManifest
from vlfit.index.shard_embedding import ShardWork
from vlfit.index.store import EmbeddingIndex
from vlfit.index.transaction import BuildTransaction
from vlfit.index.verify import damaged_shards
from vlfit.inference.backends import Encoder

logger = logging.getLogger(__name__)


def build_index(
    encoder: Encoder,
    source: ImageTextSource | ShardCollection,
    request: BuildRequest,
    *,
    index: EmbeddingIndex | None,
    on_shard: Callable[[IndexManifest], None] | None = None,
    distributor: Distributor | None = None,
) -> BuiltIndex:
    """Embed every item of ``source`` not in the index at ``request.output_dir`` yet, and add it (creating the index).

    The items to embed are cut into shards in collection order; tar shards at URLs (a ``ShardCollection``) make
    one index shard each, and are fetched one at a time (the next while this one is embedded) beside the index,
    then deleted. On several processes (``world_size`` > 1, in an initialized ``torch.distributed`` group:
    ``torchrun ... vlfit retrieve index``), process ``rank`` embeds and writes shards ``rank``,
    ``rank + world_size``, ...; after each round of ``world_size`` shards, rank 0 lists them in the manifest in
    order (``vlfit.index.transaction``). The index is the one a single process builds: the same shards of the same
    items, embedded in the same batches; a build stopped midway resumes at the first shard the manifest does not
    list, on any number of processes. ``distributor`` says who writes the shards (``vlfit.index.distribute``):
    this process, or under torchrun each rank its share (``TorchRanks``, the default), or Ray's actors, whose parts
    this process lists as they come (``RayTasks``: the request is then one process's, rank 0 of 1).

    Args:
        encoder: The model, on its backend.
        source: The images (an ``ImageFolderSource``, a dataset split, or a ``ShardCollection``).
        request: Where the index goes, what ``source`` is, and how it is embedded.
        index: The index at ``request.output_dir`` as the caller opened it (``EmbeddingIndex.existing``: the
            manifest is read once per job), None for a new one.
        on_shard: Called with the manifest after each round of shards is listed (rank 0).
        distributor: Who writes the shards (None: ``TorchRanks``).

    Returns:
        The index as built (as rank 0 wrote it; other ranks get theirs without the new shards), the rows this build
        added and the items it left out.

    Raises:
        vlfit.inference.identity.RefusedModelError: when the index exists and was built with a model whose
            embeddings are not comparable.
    """
    os.makedirs(request.output_dir, exist_ok=True)
    streamed = isinstance(source, ShardCollection)
    items = None if streamed else image_items(source)  # a folder's files by absolute path (their ids never collide)
    if index is None:
        manifest, first_number, replaced, done = _new_manifest(encoder, request.storage), 0, [], set()
        collection = 0
    else:
        manifest, first_number = index.manifest, _next_shard_number(index.manifest)
        collection = len(manifest.collections)  # the position this build's entry takes in collections
        encoder.check_embeds_into(manifest.identity, f"the index {index.path}")
        manifest.check_appendable(encoder.spec.max_num_patches, None, index.path)
        damaged = damaged_shards(index, request.verify)
        # Each shard's ids, read once (of tar shards at URLs, only the damaged ones': the sources name the rest).
        held = index.shard_id_lists(damaged if streamed else range(len(manifest.shards)), damaged)
        repaired, replaced, kept = _repair_damaged_shards(encoder, index, source, items, request, first_number,
                                                          damaged, held)  # fmt: skip
        first_number += repaired
        done = _already_done(manifest, source, [held[position] for position in kept if held.get(position)])
    transaction = BuildTransaction(request, manifest, replaced, collection)
    if streamed:
        todo = [url for url in source.urls if url not in done]
        manifest.collections.append({**request.collection, "shards": len(source.urls), "new_shards": len(todo)})
    else:
        todo = [i for i, item in enumerate(items.ids) if item not in done]
        counts = {"items": len(items), "records": len(source), "new": len(todo)}
        manifest.collections.append({**request.collection, **counts})
    if not todo:
        return transaction.commit()
    manifest.ann = None  # it will not cover the new shards: queries scan them until it is brought up to date
    if streamed:
        work = ShardWork(source, None, todo, first_number, manifest.storage, request)
    else:
        rows_per_shard = -(-request.shard_size // request.batch_size) * request.batch_size
        shards = [todo[start : start + rows_per_shard] for start in range(0, len(todo), rows_per_shard)]
        work = ShardWork(source, items, shards, first_number, manifest.storage, request)
    sizes, unit = work.sizes(), "shard" if streamed else "img"
    parts = (distributor or TorchRanks()).parts(encoder, work)
    progress = tqdm(total=sum(sizes), unit=unit, desc="index", disable=not (request.progress and request.lead))
    with progress as bar, contextlib.closing(parts):  # closed: a distributor's processes stop with the build
        for part in parts:
            bar.update(sum(sizes[p.position] for p in transaction.record(part)))
            if request.lead and on_shard is not None:
                on_shard(manifest)
        while transaction.rounds < -(-len(sizes) // request.world_size):  # rounds where this process has no shard
            transaction.record(None)
    return transaction.commit()


def _new_manifest(encoder: Encoder, storage: str) -> IndexManifest:
    """The manifest of a new index of ``encoder``'s embeddings (refused for a preset's random weights)."""
    if encoder.model_path.startswith("preset:"):
        raise ConfigError(
            f"--model {encoder.model_path.removeprefix('preset:')} is a preset: random weights, drawn again at "
            "each load, so an index of them could not be searched; index a trained run (the --output_dir of vlfit "
            "train) or a pretrained checkpoint"
        )
    where = encoder.model_path  # a folder by its absolute path; a hub id as it is
    model = {"path": os.path.abspath(where) if os.path.exists(where) else where, "backend": encoder.backend,
             "precision": encoder.precision, "max_seq_length": encoder.spec.max_seq_length}  # fmt: skip
    if encoder.spec.max_num_patches is not None:  # NaFlex: the patch budget its items were embedded at
        model["max_num_patches"] = encoder.spec.max_num_patches
    if encoder.embedding_dim is not None:  # --embedding_dim: the size its items were cut to, and its queries are
        model["embedding_dim"] = encoder.embedding_dim
    return IndexManifest(encoder.identity, model, storage)


def _repair_damaged_shards(
    encoder: Encoder,
    index: EmbeddingIndex,
    source: ImageTextSource | ShardCollection,
    items: ImageItems | None,
    request: BuildRequest,
    first_number: int,
    damaged: dict[int, list[tuple[str, str]]],
    held: dict[int, list[str] | None],
) -> tuple[int, list[dict[str, Any]], list[int]]:
    """Embed each ``damaged`` shard of ``index`` again in its place, into shard files numbered from
    ``first_number``, when its ids are known (``held``, and its ids file not among its problems) and ``source`` still
    holds its items (rank 0; every process decides alike); take the others off the manifest, so that their items are
    embedded at the end. Returns how many shard numbers the repair took (the same on every process), the damaged
    shards' entries (their files go once the manifest is written without them), and the positions, as the manifest
    was, of the shards whose items the index holds now."""
    manifest = index.manifest
    if not damaged:
        return 0, [], list(range(len(manifest.shards)))
    in_place = {}  # the damaged shards whose ids file is whole: their items are known
    for position, problems in damaged.items():
        ids, ids_file = held.get(position), os.path.join(index.path, manifest.shards[position]["ids"])
        if ids and all(file != ids_file for file, _ in problems):
            in_place[position] = ids
    if items is not None:  # a folder or split: the items must still be there
        present = set(items.ids)
        in_place = {position: ids for position, ids in in_place.items() if present.issuperset(ids)}
    for position in damaged:  # embedded again at the end: only from the collection they came from
        if position not in in_place and (foreign := _other_collection(index, position, request.collection)):
            file, what = damaged[position][0]
            raise DataError(f"{file}: {what}; its shard's items come from {foreign}, not from this build's, so this "
                            "build would lose them: run that collection's build first (it embeds them again), then "
                            "this one")  # fmt: skip
    for position, problems in damaged.items():
        for file, what in problems:
            logger.warning(
                "%s: %s; its shard's items are embedded again %s",
                file,
                what,
                "in its place" if position in in_place else "at the end of the index: the rows after it move",
            )
    old = {position: manifest.shards[position] for position in damaged}
    if request.lead and in_place:
        alone = dataclasses.replace(request, rank=0, world_size=1)
        number = first_number
        row_of = {item: row for row, item in enumerate(items.ids)} if items is not None else {}
        for position, ids in sorted(in_place.items()):
            shard = [row_of[i] for i in ids] if items is not None else old[position]["source"]
            (part,) = ShardWork(source, items, [shard], number, manifest.storage, alone).embed(encoder, [0])
            rows = int(part.entry["count"]) if part.entry is not None else 0
            if rows < len(ids):  # images unreadable now: the rows of the shards after it move up
                logger.warning("%s held %d items; %d of them were embedded again (the rest are bad now, listed in "
                               "the manifest): the rows after it move up by %d", old[position]["embeddings"],
                               len(ids), rows, len(ids) - rows)  # fmt: skip
            manifest.bad_samples.extend(part.bad_samples)
            for key in ("source", "collection"):  # the tar shard it was made of, the collection it came from
                if part.entry is not None and key in old[position]:
                    part.entry[key] = old[position][key]
            manifest.shards[position] = part.entry  # None: every image bad now
            number += 1
    kept = [position for position in range(len(manifest.shards)) if position not in damaged or position in in_place]
    manifest.shards = [manifest.shards[position] for position in kept if manifest.shards[position] is not None]
    manifest.ann = None  # the ANN step checks the structure on disk against the rows (vlfit.index.ann_update)
    return len(in_place), list(old.values()), kept


def _other_collection(index: EmbeddingIndex, position: int, collection: dict[str, Any]) -> str | None:
    """The collection the shard at ``position`` of ``index`` came from, with its build's command, when that is not
    ``collection`` (a build's ``request.collection``); None when it is. A shard written before shards recorded their
    collection came from any of the index's: it is this one only when all of them are."""
    shard = index.manifest.shards[position]
    recorded = index.manifest.collection_of(shard)
    candidates = index.manifest.collections if recorded is None else [recorded]
    asked = [collection.get(key) for key in COLLECTION_KEYS]  # the flags that open this build's collection again
    if all([entry.get(key) for key in COLLECTION_KEYS] == asked for entry in candidates):
        return None
    if recorded is not None:
        return f"another collection ({index.rebuild_command(shard=shard)})"
    return (
        "one of the index's collections (its shards were written before they recorded theirs; the manifest "
        "lists the collections)"
    )


def _already_done(
    manifest: IndexManifest, source: ImageTextSource | ShardCollection, shard_ids: list[list[str]]
) -> set[str]:
    """What the index of ``manifest`` holds already: the ids indexed (``shard_ids``, its shards') or listed as bad, or
    for tar shards at URLs the shards an index shard was made of (a shard given up earlier is taken off the bad list,
    to be tried again). Re-indexing a folder lists, in the manifest, the files gone from it (a file that came back is
    taken off the list)."""
    if isinstance(source, ShardCollection):
        done = {shard.get("source") for shard in manifest.shards}
        retried = set(source.urls) - done
        manifest.bad_samples = [bad for bad in manifest.bad_samples if bad["id"] not in retried]
        return done
    indexed = {item for ids in shard_ids for item in ids}
    if source.item_folder is not None:  # the files gone from it are listed, those of other folders kept; a dataset
        root = os.path.join(source.item_folder, "")  # split (no item_folder) loses no records: its list stays
        present = set(source.image_ids())
        gone = sorted(item for item in indexed if item.startswith(root) and item not in present)
        manifest.removed = [item for item in manifest.removed if not item.startswith(root)] + gone
    return indexed | {bad["id"] for bad in manifest.bad_samples}


def _next_shard_number(manifest: IndexManifest) -> int:
    """The number after every shard file the manifest names (a shard whose images were all bad has no file, so
    numbers may skip; a new shard never takes the name of one listed)."""
    numbers = [int(shard["ids"].split("-")[1].split(".")[0]) for shard in manifest.shards]
    return max(numbers, default=-1) + 1


__all__ = ["BuildRequest", "BuiltIndex", "build_index"]
