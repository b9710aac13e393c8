"""A resumable, appendable index of image embeddings: shards of embeddings plus a JSON manifest naming the model.

Layout::

    index_manifest.json          model identity (family, embedding size, checkpoint hash), the model folder and
                                 backend it was built with, the shards in order, the bad images left out, the items
                                 removed from their folder since, and the ANN structure (``ann``) if one was built
    shard-00000.safetensors      float32 embeddings [n, D] (or shard-00000.npy with --storage npy)
    shard-00000.json             the n item ids, in row order
    shard-00000.captions.json    the n items' captions (a list each), for items of a dataset split or tar shards
    ann.faiss, ann.json          the approximate-nearest-neighbour structure over every row, and its description
                                 (``vlfit.index.ann_update``; the shards stay the store of record)

An item is one image. An image folder's items are its files, each id the file's absolute path. A dataset split's (or
tar shard's) records that show one image (one ``--image_id_column`` value, one row of a list caption column, or
identical bytes: ``vlfit.data.image_groups``, as evaluation groups them) are one item: embedded once, its id the
image id or else its first record's id, and its captions all of theirs (``captions`` of the shard's manifest entry;
an index built before items had captions has none). Building
embeds, in collection order, every item whose id is not in the index yet (nor listed as bad), and writes a shard
each ``shard_size`` items, the manifest after it: an interrupted build resumes at the first unwritten shard with the
same batches, so its index equals one built in one go, and running it again over a folder that gained images
appends them. Tar shards at URLs (``ShardCollection``) are indexed a tar shard at a time, each into one index
shard whose manifest entry names it (``source``): a resumed or repeated build fetches only the tar shards not listed
(one given up earlier is tried again), and the disk holds two tar shards per process, not the set.

Rows are never deleted: re-indexing a folder lists, under ``removed``, the ids of its files that are gone (and
takes back one that returned), and queries leave those rows out. A manifest names an ANN structure only while it
covers exactly its shards: a build that adds rows drops ``ann`` before writing the first new shard.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from vlfit.atomic_files import replace_on_success, write_text_atomically
from vlfit.data.batch import Batch
from vlfit.data.image_groups import ImageItems, image_items
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.tar import ShardCollection, TarSource
from vlfit.errors import ConfigError, DataError, MissingFileError, first_line
from vlfit.inference.backends import Encoder
from vlfit.inference.identity import ModelIdentity

if TYPE_CHECKING:
    from vlfit.index.ann import AnnIndex

logger = logging.getLogger(__name__)

MANIFEST_NAME = "index_manifest.json"
STORAGES = ("safetensors", "npy")
EMBEDDINGS_KEY = "embeddings"


@dataclass
class IndexManifest:
    """What ``index_manifest.json`` holds.

    Attributes:
        identity: The model the embeddings come from.
        model: ``{"path", "backend", "precision"}`` of the encoder that built the index.
        storage: ``safetensors`` or ``npy``.
        shards: ``{"embeddings", "ids", "count"}`` per shard, in order (and ``"captions"``: its items' captions).
        bad_samples: ``{"id", "reason"}`` of every item left out.
        collections: What was embedded into the index, one entry per build or append.
        removed: Ids of indexed items whose files have left their folder since (left out of results).
        ann: The description of ``ann.faiss`` when it covers every row (``vlfit.index.ann_update``), else None.
    """

    identity: ModelIdentity
    model: dict[str, str]
    storage: str = "safetensors"
    shards: list[dict[str, Any]] = field(default_factory=list)
    bad_samples: list[dict[str, str]] = field(default_factory=list)
    collections: list[dict[str, Any]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    ann: dict[str, Any] | None = None

    @property
    def count(self) -> int:
        return sum(int(shard["count"]) for shard in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": 1,
            "identity": self.identity.to_dict(),
            "model": self.model,
            "storage": self.storage,
            "count": self.count,
            "shards": self.shards,
            "bad_samples": self.bad_samples,
            "collections": self.collections,
            "removed": self.removed,
            **({"ann": self.ann} if self.ann else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexManifest:
        return cls(
            identity=ModelIdentity.from_dict(data["identity"]),
            model=dict(data["model"]),
            storage=str(data.get("storage", "safetensors")),
            shards=list(data["shards"]),
            bad_samples=list(data.get("bad_samples", [])),
            collections=list(data.get("collections", [])),
            removed=list(data.get("removed", [])),
            ann=data.get("ann"),
        )


class EmbeddingIndex:
    """An index folder, read shard by shard.

    Args:
        path: The folder.

    Raises:
        FileNotFoundError: when it holds no index.
    """

    def __init__(self, path: str) -> None:
        manifest_path = os.path.join(path, MANIFEST_NAME)
        if not os.path.isfile(manifest_path):
            raise MissingFileError(f"--index {path}: no {MANIFEST_NAME}; build one with vlfit retrieve index")
        with open(manifest_path, encoding="utf-8") as f:
            self.manifest = IndexManifest.from_dict(json.load(f))
        self.path = path
        self._item_captions: dict[str, list[str]] | None = None
        self._held: tuple[list[str], torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.manifest.count

    def shard_ids(self, shard: dict[str, Any]) -> list[str]:
        with open(os.path.join(self.path, shard["ids"]), encoding="utf-8") as f:
            return list(json.load(f))

    def shard_embeddings(self, shard: dict[str, Any]) -> torch.Tensor:
        file = os.path.join(self.path, shard["embeddings"])
        if file.endswith(".npy"):
            return torch.from_numpy(np.load(file))
        from safetensors.torch import load_file

        return load_file(file)[EMBEDDINGS_KEY]

    def shards(self) -> Iterator[tuple[list[str], torch.Tensor]]:
        """``(ids, embeddings [n, D])`` of each shard, in order."""
        for shard in self.manifest.shards:
            yield self.shard_ids(shard), self.shard_embeddings(shard)

    def ids(self) -> list[str]:
        return [item for shard in self.manifest.shards for item in self.shard_ids(shard)]

    def shard_captions(self, shard: dict[str, Any]) -> list[list[str]] | None:
        """The captions of each item of a shard, in row order (``None``: the shard stores none)."""
        if not shard.get("captions"):
            return None
        with open(os.path.join(self.path, shard["captions"]), encoding="utf-8") as f:
            return [list(captions) for captions in json.load(f)]

    def item_captions(self) -> dict[str, list[str]]:
        """Item id -> its captions, for the items whose shards store them (read once, then kept)."""
        if self._item_captions is None:
            found: dict[str, list[str]] = {}
            for shard in self.manifest.shards:
                captions = self.shard_captions(shard)
                if captions is not None:
                    found.update(zip(self.shard_ids(shard), captions, strict=True))
            self._item_captions = found
        return self._item_captions

    def removed_rows(self, ids: list[str] | None = None) -> list[int]:
        """The rows of items removed from their folder since they were indexed (``ids``: ``self.ids()``)."""
        if not self.manifest.removed:
            return []
        removed = set(self.manifest.removed)
        return [row for row, item in enumerate(self.ids() if ids is None else ids) if item in removed]

    # What a search reads, read once per EmbeddingIndex (one manifest): a server answers every query from one.

    @cached_property
    def row_ids(self) -> list[str]:
        """The item id of each row: ``ids()``, read once (a list to read, not to change)."""
        return self.ids()

    @cached_property
    def left_out_rows(self) -> list[int]:
        """``removed_rows()``, read once, in increasing order: the rows no search returns."""
        return self.removed_rows(self.row_ids)

    @cached_property
    def ann(self) -> AnnIndex | None:
        """The ANN structure the manifest names (memory-mapped, re-ranking from the shards), opened once; None when
        it names none or the file on disk is not the one it names (then searches scan the shards)."""
        described = self.manifest.ann
        if not described:
            return None
        from vlfit.index.ann import ANN_FILE, AnnIndex

        ann = AnnIndex.load(self.path, mmap=True, vectors=self.vectors())  # re-ranking reads the shards
        if len(ann) != self.manifest.count or ann.description.get("ids_digest") != described.get("ids_digest"):
            logger.warning("%s: %s does not match the manifest; scanning the shards", self.path, ANN_FILE)
            return None
        return ann

    def hold_embeddings(self) -> torch.Tensor:
        """Read every embedding into memory once (float32 ``[N, D]``): exact searches then scan it rather than
        read the shard files again for each query (a server without an ANN structure)."""
        if self._held is None:
            self._held = (self.row_ids, self.embeddings().float())
        return self._held[1]

    def scanned_shards(self) -> Iterator[tuple[list[str], torch.Tensor]]:
        """What an exact search scans, in row order: the embeddings held in memory as one part, else each shard."""
        if self._held is not None:
            yield self._held
        else:
            yield from self.shards()

    def embeddings(self) -> torch.Tensor:
        """Every embedding at once ``[N, D]`` (tests and small indexes; queries read shard by shard)."""
        parts = [embeddings for _, embeddings in self.shards()]
        size = self.manifest.identity.embedding_size
        return torch.cat(parts) if parts else torch.empty(0, size)

    def vectors(self) -> ShardVectors:
        """The embeddings as memory-mapped shards, read by row (``vectors[rows]``) without loading the index."""
        shards = self.manifest.shards
        return ShardVectors(
            [os.path.join(self.path, shard["embeddings"]) for shard in shards],
            [int(shard["count"]) for shard in shards],
            self.manifest.identity.embedding_size,
        )


def _mapped_shard(file: str, dim: int) -> np.ndarray:
    """The ``[n, D]`` float32 embeddings of one shard file, memory-mapped.

    A ``.safetensors`` file is 8 bytes of little-endian header length, a JSON header giving the tensor's dtype,
    shape and byte range, then the data (the format's specification); a ``.npy`` file maps through numpy.

    Raises:
        DataError: when the file does not hold float32 embeddings of size ``dim``.
    """
    if file.endswith(".npy"):
        mapped = np.load(file, mmap_mode="r")
    else:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        entry = header.get(EMBEDDINGS_KEY) or {}
        begin, end = entry.get("data_offsets", (0, 0))
        shape = tuple(entry.get("shape", ()))
        if entry.get("dtype") != "F32" or len(shape) != 2 or end - begin != 4 * shape[0] * shape[1]:
            raise DataError(f"{file}: not a shard of float32 embeddings (header {entry}); rebuild the index")
        mapped = np.memmap(file, dtype=np.float32, mode="r", offset=8 + length + begin, shape=shape)
    if mapped.dtype != np.float32 or mapped.ndim != 2 or mapped.shape[1] != dim:
        raise DataError(f"{file}: holds {mapped.dtype} {mapped.shape}, not float32 embeddings of size {dim}")
    return mapped


class ShardVectors:
    """An index's embeddings by row, straight from its memory-mapped shards: a query's candidates are read,
    not the index (what the operating system caches of the files is shared, and given back under pressure). A
    shard is mapped when a row of it is first read.

    Args:
        files: The shard files, in row order.
        counts: The rows of each.
        dim: The embedding size.
    """

    def __init__(self, files: list[str], counts: list[int], dim: int) -> None:
        self.files = files
        self.dim = dim
        self.starts = np.cumsum([0, *counts])
        self._mapped: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard(self, number: int) -> np.ndarray:
        mapped = self._mapped.get(number)
        if mapped is None:
            mapped = _mapped_shard(self.files[number], self.dim)
            if len(mapped) != self.starts[number + 1] - self.starts[number]:
                raise DataError(f"{self.files[number]}: holds {len(mapped)} rows, the manifest says otherwise")
            mapped = self._mapped.setdefault(number, mapped)
        return mapped

    def __getitem__(self, rows: Any) -> np.ndarray:
        """The float32 embeddings ``[len(rows), D]`` of ``rows`` (any order, repeats allowed)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows must be in [0, {len(self)}), got {rows.min()}..{rows.max()}")
        out = np.empty((rows.size, self.dim), dtype=np.float32)
        shard_of = np.searchsorted(self.starts, rows, side="right") - 1
        for number in np.unique(shard_of).tolist():
            picked = shard_of == number
            out[picked] = self._shard(number)[rows[picked] - self.starts[number]]
        return out


def _write_shard(
    folder: str,
    number: int,
    ids: list[str],
    embeddings: torch.Tensor,
    storage: str,
    captions: list[list[str]] | None = None,
) -> dict[str, Any]:
    stem = f"shard-{number:05d}"
    name = f"{stem}.{storage}"
    with replace_on_success(os.path.join(folder, name)) as temp:
        if storage == "npy":
            with open(temp, "wb") as f:
                np.save(f, embeddings.numpy())
        else:
            from safetensors.torch import save_file

            save_file({EMBEDDINGS_KEY: embeddings.contiguous()}, temp)
    entry: dict[str, Any] = {"embeddings": name, "ids": f"{stem}.json", "count": len(ids)}
    if captions is not None:
        entry["captions"] = f"{stem}.captions.json"
        write_text_atomically(os.path.join(folder, entry["captions"]), json.dumps(captions) + "\n")
    write_text_atomically(os.path.join(folder, f"{stem}.json"), json.dumps(ids) + "\n")
    return entry


def write_manifest(folder: str, manifest: IndexManifest) -> None:
    """Write ``index_manifest.json`` atomically (after the files it names)."""
    write_text_atomically(os.path.join(folder, MANIFEST_NAME), json.dumps(manifest.to_dict(), indent=1) + "\n")


def write_index_from_embeddings(
    folder: str,
    identity: ModelIdentity,
    model: dict[str, str],
    ids: list[str],
    embeddings: torch.Tensor,
    *,
    collection: dict[str, Any],
    shard_size: int = 50_000,
    storage: str = "safetensors",
) -> IndexManifest:
    """A new index at ``folder`` holding ``embeddings`` [N, D] (rows of ``ids``) computed elsewhere, in shards of
    ``shard_size`` rows; ``model`` is ``{"path", "backend", "precision"}`` of what embedded them.

    Raises:
        ConfigError: when ``folder`` already holds an index, or ids and embeddings do not pair up.
    """
    if os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        raise ConfigError(f"{folder} already holds an index; write a new one to an empty folder")
    if embeddings.ndim != 2 or len(ids) != len(embeddings) or embeddings.shape[1] != identity.embedding_size:
        raise ConfigError(
            f"{len(ids)} ids need embeddings [{len(ids)}, {identity.embedding_size}], got {list(embeddings.shape)}"
        )
    os.makedirs(folder, exist_ok=True)
    manifest = IndexManifest(identity, dict(model), storage)
    for number, start in enumerate(range(0, len(ids), shard_size)):
        rows = slice(start, start + shard_size)
        manifest.shards.append(_write_shard(folder, number, ids[rows], embeddings[rows].float(), storage))
    manifest.collections.append({**collection, "items": len(ids), "new": len(ids)})
    write_manifest(folder, manifest)
    return manifest


def _removed_ids(source: ImageTextSource, manifest: IndexManifest, indexed: set[str]) -> list[str]:
    """The indexed ids under the ``item_folder`` of ``source`` it no longer holds, with those of other folders
    already listed; a file that came back is taken off the list. Dataset splits (no ``item_folder``) do not lose
    records: their list stays as it was."""
    if source.item_folder is None:
        return manifest.removed
    root = os.path.join(source.item_folder, "")
    present = set(source.image_ids())
    others = [item for item in manifest.removed if not item.startswith(root)]
    gone = sorted(item for item in indexed if item.startswith(root) and item not in present)
    return others + gone


@dataclass(frozen=True)
class _ShardPart:
    """What one process made of one shard of a build: its manifest entry (None when every image was bad), and
    the items it left out."""

    position: int
    entry: dict[str, Any] | None
    bad_samples: list[dict[str, str]]


def _next_shard_number(manifest: IndexManifest) -> int:
    """The number after every shard file the manifest names (a shard whose images were all bad has no file, so
    numbers may skip; a new shard never takes the name of one listed)."""
    numbers = [int(shard["ids"].split("-")[1].split(".")[0]) for shard in manifest.shards]
    return max(numbers, default=-1) + 1


def _gather_parts(part: _ShardPart | None, world_size: int) -> list[_ShardPart]:
    """Every process's part of one round, on rank 0 (an empty list elsewhere)."""
    if world_size == 1:
        return [part] if part is not None else []
    import torch.distributed as dist

    parts: list[_ShardPart | None] | None = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    return [p for p in parts or [] if p is not None]


def _record_round(
    part: _ShardPart | None, output_dir: str, manifest: IndexManifest, world_size: int
) -> list[_ShardPart]:
    """One round: every process's shard file is written; rank 0 lists the round's shards in order and writes the
    manifest (a build stopped in between redoes them). Returns the parts listed (rank 0; none elsewhere)."""
    parts = _gather_parts(part, world_size)
    for done_part in sorted(parts, key=lambda p: p.position):
        manifest.bad_samples.extend(done_part.bad_samples)
        if done_part.entry is not None:
            manifest.shards.append(done_part.entry)
    if parts:
        write_manifest(output_dir, manifest)
    return parts


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
            parts.append(encoder.embed_pixels(batch["pixel_values"]).float().cpu())
            ids.extend(to_item(sample_id) for sample_id in batch.sample_ids)
    return ids, parts, bad


def build_index(
    encoder: Encoder,
    source: ImageTextSource | ShardCollection,
    output_dir: str,
    *,
    collection: dict[str, Any],
    batch_size: int = 32,
    num_workers: int = 0,
    shard_size: int = 1024,
    storage: str = "safetensors",
    progress: bool = True,
    on_shard: Callable[[IndexManifest], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> IndexManifest:
    """Embed every item of ``source`` not in the index at ``output_dir`` yet, and add it (creating the index).

    The items to embed are cut into shards in collection order; tar shards at URLs (a ``ShardCollection``) make
    one index shard each, and are fetched one at a time (the next while this one is embedded) beside the index,
    then deleted. On several processes (``world_size`` > 1, in an initialized ``torch.distributed`` group:
    ``torchrun ... vlfit retrieve index``), process ``rank`` embeds and writes shards ``rank``,
    ``rank + world_size``, ...; after each round of ``world_size`` shards, rank 0 lists them in the manifest in
    order. The index is the one a single process builds: the same shards of the same items, embedded in the same
    batches; a build stopped midway resumes at the first shard the manifest does not list, on any number of
    processes.

    Args:
        encoder: The model, on its backend.
        source: The images (an ``ImageFolderSource``, a dataset split, or a ``ShardCollection``).
        output_dir: The index folder.
        collection: What ``source`` is (recorded in the manifest).
        batch_size: Images per forward pass.
        num_workers: Loader worker processes decoding and resizing (per process).
        shard_size: Items per shard (rounded up to whole batches, so a resumed build forms the same batches);
            a ``ShardCollection``'s index shards are its tar shards.
        storage: ``safetensors`` or ``npy`` (of a new index; an existing one keeps its own).
        progress: Show a progress bar (rank 0's).
        on_shard: Called with the manifest after each round of shards is listed (rank 0).
        rank: This process's rank.
        world_size: How many processes build together.

    Returns:
        The index's manifest (as rank 0 wrote it; other ranks get theirs without the new shards).

    Raises:
        vlfit.inference.identity.RefusedModelError: when the index exists and was built with a model whose
            embeddings are not comparable.
    """
    if storage not in STORAGES:
        raise ConfigError(f"unknown --storage {storage!r}; choose one of: {', '.join(STORAGES)}")
    if batch_size < 1 or shard_size < 1:
        raise ConfigError(f"--batch_size and --shard_size must be at least 1, got {batch_size} and {shard_size}")
    lead = rank == 0
    if lead:
        os.makedirs(output_dir, exist_ok=True)
    streamed = isinstance(source, ShardCollection)
    if os.path.isfile(os.path.join(output_dir, MANIFEST_NAME)):
        manifest = EmbeddingIndex(output_dir).manifest
        manifest.identity.check_compatible(
            encoder.identity, what=f"the index {output_dir}", other_what=f"the model {encoder.model_path}"
        )
        if streamed:  # a tar shard is done once an index shard is made of it; one given up is tried again
            done = {shard.get("source") for shard in manifest.shards}
            retried = set(source.urls) - done
            manifest.bad_samples = [bad for bad in manifest.bad_samples if bad["id"] not in retried]
        else:
            indexed = set(EmbeddingIndex(output_dir).ids())
            manifest.removed = _removed_ids(source, manifest, indexed)
            done = indexed | {bad["id"] for bad in manifest.bad_samples}
    else:
        model = {"path": os.path.abspath(encoder.model_path), "backend": encoder.backend}
        manifest = IndexManifest(encoder.identity, {**model, "precision": encoder.precision}, storage)
        done = set()
    if streamed:
        todo = [url for url in source.urls if url not in done]
        manifest.collections.append({**collection, "shards": len(source.urls), "new_shards": len(todo)})
    else:
        items = image_items(source)  # a folder's files by absolute path (their image ids: two never collide)
        todo = [i for i, item in enumerate(items.ids) if item not in done]
        manifest.collections.append({**collection, "items": len(items), "records": len(source), "new": len(todo)})
    if todo:
        manifest.ann = None  # it will not cover the new shards: queries scan them until it is brought up to date
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # every process has read the manifest before rank 0 rewrites it
    if lead:
        write_manifest(output_dir, manifest)
    if not todo:
        return manifest
    first_number = _next_shard_number(manifest)
    embed = {"batch_size": batch_size, "num_workers": num_workers, "rank": rank, "world_size": world_size}
    if streamed:
        sizes, unit = [1] * len(todo), "shard"
        parts = _embed_shards(encoder, source, todo, output_dir, first_number, manifest.storage, **embed)
    else:
        rows_per_shard = -(-shard_size // batch_size) * batch_size
        shards = [todo[start : start + rows_per_shard] for start in range(0, len(todo), rows_per_shard)]
        sizes, unit = [len(shard) for shard in shards], "img"
        parts = _embed_rows(encoder, source, items, shards, output_dir, first_number, manifest.storage, **embed)
    bar = tqdm(total=sum(sizes), unit=unit, desc="index", disable=not (progress and lead))
    rounds = 0
    try:
        for part in parts:
            listed = _record_round(part, output_dir, manifest, world_size)
            rounds += 1
            bar.update(sum(sizes[p.position] for p in listed))
            if lead and on_shard is not None:
                on_shard(manifest)
        for _ in range(rounds, -(-len(sizes) // world_size)):  # rounds where this process has no shard
            _record_round(None, output_dir, manifest, world_size)
    finally:
        bar.close()
    return manifest


def _embed_rows(
    encoder: Encoder,
    source: ImageTextSource,
    items: ImageItems,
    shards: list[list[int]],
    output_dir: str,
    first_number: int,
    storage: str,
    *,
    batch_size: int,
    num_workers: int,
    rank: int,
    world_size: int,
) -> Iterator[_ShardPart]:
    """This process's shards of items (positions ``rank``, ``rank + world_size``...), each embedded into one index
    shard file, through one loader over all of them (an item's first record stands for its image)."""
    mine = list(range(rank, len(shards), world_size))
    to_item = _item_of_record(items)
    batches = host_batches(
        source.select([items.rows[item] for position in mine for item in shards[position]]),
        encoder.spec,
        batch_size=batch_size,
        num_workers=num_workers,
    )
    batch_iter = iter(batches)
    for position in mine:
        ids, parts, bad = _embed_batches(encoder, batch_iter, to_item, -(-len(shards[position]) // batch_size))
        entry = _write_items(output_dir, first_number + position, ids, parts, storage, items) if ids else None
        yield _ShardPart(position, entry, bad)


def _item_of_record(items: ImageItems) -> Callable[[str], str]:
    """The item id of a record id (of an item's first record: the one embedded)."""
    item_of = dict(zip(items.record_ids, items.ids, strict=True))
    return lambda record_id: item_of.get(record_id, record_id)


def _write_items(
    folder: str, number: int, ids: list[str], parts: list[torch.Tensor], storage: str, items: ImageItems
) -> dict[str, Any]:
    """``_write_shard`` of embedded items, with their captions when the items have some."""
    captions = None
    if items.captions is not None:
        captions_of = dict(zip(items.ids, items.captions, strict=True))
        captions = [captions_of[item] for item in ids]
    return _write_shard(folder, number, ids, torch.cat(parts), storage, captions)


FETCH_FOLDER = ".fetching"  # inside the index folder: the tar shards being embedded, one process's each


def _embed_shards(
    encoder: Encoder,
    shards: ShardCollection,
    todo: list[str],
    output_dir: str,
    first_number: int,
    storage: str,
    *,
    batch_size: int,
    num_workers: int,
    rank: int,
    world_size: int,
) -> Iterator[_ShardPart]:
    """This process's tar shards of ``todo`` (positions ``rank``, ``rank + world_size``...), each fetched to a
    local copy (the next one while this one is embedded), embedded into one index shard file, and deleted. A
    shard that cannot be fetched or read is a bad item named by its URL."""
    from vlfit.data.stream import ShardUnreadableError

    reader = shards.reader()
    folder = os.path.join(output_dir, FETCH_FOLDER, f"rank-{rank:05d}")
    os.makedirs(folder, exist_ok=True)
    mine = list(range(rank, len(todo), world_size))

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
                batches = iter(host_batches(selected, encoder.spec, batch_size=batch_size, num_workers=num_workers))
                ids, parts, bad = _embed_batches(encoder, batches, _item_of_record(items))
            except (ShardUnreadableError, DataError) as err:
                yield _ShardPart(position, None, [{"id": url, "reason": f"shard not indexed: {first_line(err, 300)}"}])
                continue
            finally:
                if path is not None and os.path.exists(path):
                    os.remove(path)
            entry = None
            if ids:
                entry = {**_write_items(output_dir, first_number + position, ids, parts, storage, items), "source": url}
            yield _ShardPart(position, entry, bad)
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(folder))  # the last process out removes the fetch folder


def refuse_other_model(index: EmbeddingIndex, encoder: Encoder) -> None:
    """Raise ``RefusedModelError`` unless ``encoder`` embeds into the index's space."""
    index.manifest.identity.check_compatible(
        encoder.identity, what=f"the index {index.path}", other_what=f"the model {encoder.model_path}"
    )


__all__ = [
    "EmbeddingIndex",
    "IndexManifest",
    "ShardVectors",
    "build_index",
    "refuse_other_model",
    "write_index_from_embeddings",
    "write_manifest",
]
