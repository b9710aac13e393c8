"""The store of an index: its manifest, its shards of embeddings, and the one reader of them.

Layout::

    index_manifest.json          model identity (family, embedding size, checkpoint hash), the model folder and
                                 backend it was built with, the shards in order, the bad images left out, the items
                                 removed from their folder since, and the ANN structure (``ann``) if one was built
    shard-00000.safetensors      float32 embeddings [n, D] (or shard-00000.npy with --storage npy)
    shard-00000.json             the n item ids, in row order
    shard-00000.captions.json    the n items' captions (a list each), for items of a dataset split or tar shards
    ann.faiss, ann.json          the approximate-nearest-neighbour structure over every row, and its description
                                 (``vlfit.index.ann_update``; the shards stay the store of record)

Shards are read one way: memory-mapped (``ShardVectors``; a ``.safetensors`` file's header is parsed and its data
mapped, a ``.npy`` file is mapped by numpy), by exact search (a shard at a time, as torch tensors over the mapped
pages: no copy), by the ANN structure's rebuilds (every row) and by its re-ranking (a query's candidates, by row).
What the operating system caches of the files is shared between processes and given back under pressure.

Rows are never deleted: re-indexing a folder lists, under ``removed``, the ids of its files that are gone (and
takes back one that returned), and queries leave those rows out. A manifest names an ANN structure only while it
covers exactly its shards: a build that adds rows drops ``ann`` before writing the first new shard. Building an
index (what it embeds, in which shards, on how many processes) is ``vlfit.index.build``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vlfit.atomic_files import replace_on_success, write_text_atomically
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.inference.identity import ModelIdentity

if TYPE_CHECKING:
    from vlfit.index.ann import AnnIndex
    from vlfit.inference.backends import Encoder

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
        self._vectors: ShardVectors | None = None

    def __len__(self) -> int:
        return self.manifest.count

    def shard_ids(self, shard: dict[str, Any]) -> list[str]:
        with open(os.path.join(self.path, shard["ids"]), encoding="utf-8") as f:
            return list(json.load(f))

    def shards(self) -> Iterator[tuple[list[str], torch.Tensor]]:
        """``(ids, embeddings [n, D])`` of each shard, in order: float32 tensors over the memory-mapped shard files
        (``vectors()``), read as they are used."""
        vectors = self.vectors()
        for number, shard in enumerate(self.manifest.shards):
            yield self.shard_ids(shard), torch.from_numpy(vectors.shard(number))

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
            self._held = (self.row_ids, self.embeddings())
        return self._held[1]

    def scanned_shards(self) -> Iterator[tuple[list[str], torch.Tensor]]:
        """What an exact search scans, in row order: the embeddings held in memory as one part, else each shard."""
        if self._held is not None:
            yield self._held
        else:
            yield from self.shards()

    def embeddings(self) -> torch.Tensor:
        """Every embedding at once, float32 ``[N, D]`` in memory (what a rebuild of the ANN structure reads, and an
        exact-search server holds; queries otherwise read shard by shard)."""
        parts = [embeddings for _, embeddings in self.shards()]
        size = self.manifest.identity.embedding_size
        return torch.cat(parts) if parts else torch.empty(0, size)

    def vectors(self) -> ShardVectors:
        """The embeddings as memory-mapped shards (the one reader of shard files), read by row (``vectors[rows]``)
        or by shard without loading the index; made once per ``EmbeddingIndex``."""
        if self._vectors is None:
            shards = self.manifest.shards
            self._vectors = ShardVectors(
                [os.path.join(self.path, shard["embeddings"]) for shard in shards],
                [int(shard["count"]) for shard in shards],
                self.manifest.identity.embedding_size,
            )
        return self._vectors


def _mapped_shard(file: str, dim: int) -> np.ndarray:
    """The ``[n, D]`` float32 embeddings of one shard file, memory-mapped.

    A ``.safetensors`` file is 8 bytes of little-endian header length, a JSON header giving the tensor's dtype,
    shape and byte range, then the data (the format's specification); a ``.npy`` file maps through numpy. The
    mapping is copy-on-write (``mode="c"``): the file is never written, and torch can view the array without a copy.

    Raises:
        DataError: when the file does not hold float32 embeddings of size ``dim``.
    """
    if file.endswith(".npy"):
        mapped = np.load(file, mmap_mode="c")
    else:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        entry = header.get(EMBEDDINGS_KEY) or {}
        begin, end = entry.get("data_offsets", (0, 0))
        shape = tuple(entry.get("shape", ()))
        if entry.get("dtype") != "F32" or len(shape) != 2 or end - begin != 4 * shape[0] * shape[1]:
            raise DataError(f"{file}: not a shard of float32 embeddings (header {entry}); rebuild the index")
        mapped = np.memmap(file, dtype=np.float32, mode="c", offset=8 + length + begin, shape=shape)
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

    def shard(self, number: int) -> np.ndarray:
        """Shard ``number``'s embeddings ``[n, D]``, mapped when first asked for.

        Raises:
            DataError: when the file does not hold the float32 rows the manifest lists.
        """
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
            out[picked] = self.shard(number)[rows[picked] - self.starts[number]]
        return out


def write_shard(
    folder: str,
    number: int,
    ids: list[str],
    embeddings: torch.Tensor,
    storage: str,
    captions: list[list[str]] | None = None,
) -> dict[str, Any]:
    """Write shard ``number`` of ``folder`` (its embeddings, ids and captions, each atomically) and return its
    manifest entry; the manifest that lists it is written after it (``write_manifest``)."""
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
    text = json.dumps(manifest.to_dict(), indent=1) + "\n"
    write_text_atomically(os.path.join(folder, MANIFEST_NAME), text)


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
        manifest.shards.append(write_shard(folder, number, ids[rows], embeddings[rows].float(), storage))
    manifest.collections.append({**collection, "items": len(ids), "new": len(ids)})
    write_manifest(folder, manifest)
    return manifest


def refuse_other_model(index: EmbeddingIndex, encoder: Encoder) -> None:
    """Raise ``RefusedModelError`` unless ``encoder`` embeds into the index's space."""
    index.manifest.identity.check_compatible(
        encoder.identity, what=f"the index {index.path}", other_what=f"the model {encoder.model_path}"
    )


__all__ = [
    "EmbeddingIndex",
    "IndexManifest",
    "ShardVectors",
    "refuse_other_model",
    "write_index_from_embeddings",
    "write_manifest",
    "write_shard",
]
