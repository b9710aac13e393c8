"""The store of an index: its manifest and its shards of embeddings (read through ``vlfit.index.shard_vectors``).

Layout::

    index_manifest.json          model identity (family, embedding size, checkpoint hash), the model folder and
                                 backend it was built with, the shards in order, the bad images left out, the items
                                 removed from their folder since, and the ANN structure (``ann``) if one was built
    shard-00000.safetensors      float32 embeddings [n, D] (or shard-00000.npy with --storage npy)
    shard-00000.json             the n item ids, in row order
    shard-00000.captions.json    the n items' captions (a list each), for items of a dataset split or tar shards
    ann.faiss, ann.json          the approximate-nearest-neighbour structure over every row, and its description
                                 (``vlfit.index.ann_update``; the shards stay the store of record)

The manifest records the size and SHA-256 of every file it names (``files`` of each shard entry; ``bytes`` and
``sha256`` of ``ann``), each computed as the file was written; every file is flushed to disk before the manifest
that names it is written (``vlfit.index.integrity`` checks them; embeddings that are not finite are never written).

Shards are read one way: memory-mapped (``vlfit.index.shard_vectors.ShardVectors``), by exact search (a shard at a
time, as torch tensors over the mapped pages: no copy), by the ANN structure's rebuilds (every row) and by its
re-ranking (a query's candidates, by row).

Rows are never deleted: re-indexing a folder lists, under ``removed``, the ids of its files that are gone (and
takes back one that returned), and queries leave those rows out. A manifest names an ANN structure only while it
covers exactly its shards: a build that adds rows drops ``ann`` in the manifest that first lists them. Building an
index (what it embeds, in which shards, on how many processes) is ``vlfit.index.build``; when it writes the manifest,
``vlfit.index.transaction``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Container, Iterable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vlfit.atomic_files import write_file_atomically
from vlfit.data.sources.openers import COLLECTION_KEYS
from vlfit.errors import ConfigError, DataError, MissingFileError, full_disk_in_one_line
from vlfit.index.integrity import DamagedIndexError
from vlfit.index.manifest import MANIFEST_NAME, IndexManifest, write_manifest
from vlfit.index.shard_vectors import EMBEDDINGS_KEY, ShardVectors
from vlfit.inference.identity import ModelIdentity

if TYPE_CHECKING:
    from vlfit.index.ann import AnnIndex

logger = logging.getLogger(__name__)

STORAGES = ("safetensors", "npy")


def check_storage(storage: str) -> None:
    """Raises ``ConfigError`` unless ``storage`` is one of ``STORAGES``."""
    if storage not in STORAGES:
        raise ConfigError(f"unknown --storage {storage!r}; choose one of: {', '.join(STORAGES)}")


class EmbeddingIndex:
    """An index folder, read shard by shard.

    Args:
        path: The folder.
        manifest: Its manifest as the caller holds it already (a build's, ``vlfit.index.transaction``): the file is
            not read again.

    Raises:
        FileNotFoundError: when it holds no index.
    """

    def __init__(self, path: str, manifest: IndexManifest | None = None) -> None:
        self.path = path
        self._item_captions: dict[str, list[str]] | None = None
        self._held: tuple[list[str], torch.Tensor] | None = None
        self._vectors: ShardVectors | None = None
        self.manifest = read_manifest(path) if manifest is None else manifest

    @classmethod
    def existing(cls, path: str) -> EmbeddingIndex | None:
        """The index at ``path``; None when the folder holds none yet (a build creates it)."""
        return cls(path) if os.path.isfile(os.path.join(path, MANIFEST_NAME)) else None

    def __len__(self) -> int:
        return self.manifest.count

    def rebuild_command(self, *, full: bool = False, shard: dict[str, Any] | None = None) -> str:
        """The command that rebuilds what is damaged in this index (``rebuild_command``): for a damaged ``shard``,
        the build of the collection that embedded it, which alone can embed its items again in place."""
        recorded = None if shard is None else self.manifest.collection_of(shard)
        collections = self.manifest.collections if recorded is None else [recorded]
        return rebuild_command(self.path, self.manifest.model, collections, full=full)

    def read_rows(self, name: str, rows: int) -> list:
        """A shard's ids or captions file: a list of ``rows`` entries.

        Raises:
            DamagedIndexError: naming the file when it is missing, does not parse or holds another number of rows.
        """
        file = os.path.join(self.path, name)
        try:
            with open(file, encoding="utf-8") as f:
                values = json.load(f)
        except FileNotFoundError:
            problem = "missing"
        except (ValueError, OSError) as err:
            problem = f"does not parse ({type(err).__name__}: {err})"
        else:
            if isinstance(values, list) and len(values) == rows:
                return values
            problem = f"holds {len(values) if isinstance(values, list) else type(values).__name__}, not {rows} rows"
        raise DamagedIndexError(file, problem, self.rebuild_command())

    def shard_ids(self, shard: dict[str, Any]) -> list[str]:
        return [str(item) for item in self.read_rows(shard["ids"], int(shard["count"]))]

    def shard_id_lists(self, positions: Iterable[int], damaged: Container[int] = ()) -> dict[int, list[str] | None]:
        """The ids of the shards at ``positions`` (in the manifest), each file read once; None for a shard among
        ``damaged`` whose ids file does not read whole.

        Raises:
            DamagedIndexError: naming the ids file of a shard not among ``damaged`` that does not read whole.
        """
        found: dict[int, list[str] | None] = {}
        for position in positions:
            try:
                found[position] = self.shard_ids(self.manifest.shards[position])
            except DamagedIndexError:
                if position not in damaged:
                    raise
                found[position] = None
        return found

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
        return [list(captions) for captions in self.read_rows(shard["captions"], int(shard["count"]))]

    def item_captions(self) -> dict[str, list[str]]:
        """Item id -> its captions, for the items whose shards store them (read once, then kept)."""
        if self._item_captions is None:
            found: dict[str, list[str]] = {}
            ids, start = self.row_ids, 0  # each shard's ids read once (``row_ids``)
            for shard in self.manifest.shards:
                count, captions = int(shard["count"]), self.shard_captions(shard)
                if captions is not None:
                    found.update(zip(ids[start : start + count], captions, strict=True))
                start += count
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
        """The ANN structure the manifest names (read into memory, its size and checksum checked against the
        manifest as it is read, re-ranking from the shards), opened once; None when it names none or the file on
        disk is not the one it names (then searches scan the shards).

        Raises:
            DamagedIndexError: when ``ann.faiss`` is not the file the manifest records (size or checksum).
        """
        described = self.manifest.ann
        if not described:
            return None
        from vlfit.index.ann import ANN_FILE, AnnIndex

        # In memory, not memory-mapped: a file replaced or overwritten underneath cannot take the process down.
        ann = AnnIndex.load(self.path, mmap=False, vectors=self.vectors(), recorded=described,
                            repair=self.rebuild_command())  # fmt: skip
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
        return torch.from_numpy(self.vectors().all_rows())

    def vectors(self) -> ShardVectors:
        """The embeddings as memory-mapped shards (the one reader of shard files), read by row (``vectors[rows]``)
        or by shard without loading the index; made once per ``EmbeddingIndex``."""
        if self._vectors is None:
            shards, repair = self.manifest.shards, self.rebuild_command()
            self._vectors = ShardVectors(
                [os.path.join(self.path, shard["embeddings"]) for shard in shards],
                [int(shard["count"]) for shard in shards],
                self.manifest.identity.embedding_size,
                repair=repair,
            )
        return self._vectors


def write_shard(
    folder: str,
    number: int,
    ids: list[str],
    embeddings: torch.Tensor,
    storage: str,
    captions: list[list[str]] | None = None,
) -> dict[str, Any]:
    """Write shard ``number`` of ``folder`` (its embeddings, ids and captions, each atomically and flushed to disk)
    and return its manifest entry, with the size and SHA-256 of each file; the manifest that lists it is written
    after it (``write_manifest``).

    Raises:
        DataError: naming the items whose embeddings hold NaN or infinite values (nothing is written).
        DiskFullError: when the disk fills: names the folder, about what the shard needs (rows x size x 4 bytes)
            and that the index keeps the shards its manifest lists (a rerun resumes).
    """
    refuse_nonfinite(ids, embeddings)
    stem = f"shard-{number:05d}"
    name = f"{stem}.{storage}"
    with full_disk_in_one_line(
        folder,
        needed=embeddings.numel() * embeddings.element_size(),
        note="the index keeps every shard its manifest lists",
        remedy="free space there and run the same command again to resume",
    ):
        if storage == "npy":
            array = embeddings.contiguous().numpy()
            written = write_file_atomically(os.path.join(folder, name), lambda f: np.save(f, array))
        else:
            from safetensors.torch import save

            data = save({EMBEDDINGS_KEY: embeddings.contiguous()})
            written = write_file_atomically(os.path.join(folder, name), lambda f: f.write(data))
        entry: dict[str, Any] = {"embeddings": name, "ids": f"{stem}.json", "count": len(ids)}
        files = {name: written.to_dict()}
        texts = {f"{stem}.json": ids}
        if captions is not None:
            entry["captions"] = f"{stem}.captions.json"
            texts[entry["captions"]] = captions
        for file, values in texts.items():
            encoded = (json.dumps(values) + "\n").encode("utf-8")
            files[file] = write_file_atomically(os.path.join(folder, file), lambda f, b=encoded: f.write(b)).to_dict()
    return {**entry, "files": files}


def refuse_nonfinite(ids: list[str], embeddings: torch.Tensor) -> None:
    """Raise a ``DataError`` naming the items whose embeddings hold NaN or infinite values (a diverged model)."""
    finite = torch.isfinite(embeddings).all(dim=1)
    if bool(finite.all()):
        return
    bad = [ids[row] for row in (~finite).nonzero().flatten().tolist()]
    named = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise DataError(
        f"{len(bad)} of {len(ids)} items embed to NaN or infinite values, which no search can rank: {named}. The "
        "model's weights or inputs are broken (a diverged fine-tune?); nothing of them was written to the index"
    )


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
    ``shard_size`` rows; ``model`` is ``{"path", "backend", "precision", "max_seq_length"}`` of what embedded them.

    Raises:
        ConfigError: when ``folder`` already holds an index, or ids and embeddings do not pair up.
        DataError: naming the items whose embeddings hold NaN or infinite values (nothing is written).
    """
    if os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        raise ConfigError(f"{folder} already holds an index; write a new one to an empty folder")
    if embeddings.ndim != 2 or len(ids) != len(embeddings) or embeddings.shape[1] != identity.embedding_size:
        raise ConfigError(
            f"{len(ids)} ids need embeddings [{len(ids)}, {identity.embedding_size}], got {list(embeddings.shape)}"
        )
    refuse_nonfinite(ids, embeddings)  # before the folder is made
    os.makedirs(folder, exist_ok=True)
    manifest = IndexManifest(identity, dict(model), storage)
    for number, start in enumerate(range(0, len(ids), shard_size)):
        rows = slice(start, start + shard_size)
        manifest.shards.append(write_shard(folder, number, ids[rows], embeddings[rows].float(), storage))
    manifest.collections.append({**collection, "items": len(ids), "new": len(ids)})
    write_manifest(folder, manifest)
    return manifest


def read_manifest(folder: str) -> IndexManifest:
    """The manifest of the index at ``folder``.

    Raises:
        MissingFileError: when the folder holds none.
        DamagedIndexError: naming the file and the command that rebuilds the index, when it does not parse.
    """
    manifest_path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        raise MissingFileError(f"--index {folder}: no {MANIFEST_NAME}; build one with vlfit retrieve index")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = IndexManifest.from_dict(json.load(f))
        for shard in manifest.shards:
            if not (isinstance(shard.get("embeddings"), str) and isinstance(shard.get("ids"), str)):
                raise ValueError(f"a shard entry without its files: {shard}")
            shard["count"] = int(shard["count"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # JSONDecodeError, UnicodeDecodeError too
        problem = f"does not parse ({type(err).__name__}: {err})"
        raise DamagedIndexError(manifest_path, problem, rebuild_command(folder)) from None
    return manifest


def rebuild_command(
    folder: str,
    model: dict[str, Any] | None = None,
    collections: list[dict[str, Any]] | None = None,
    *,
    full: bool = False,
) -> str:
    """The command that rebuilds what is damaged in the index at ``folder``: ``vlfit retrieve index`` over the same
    folder with the model and the last of ``collections`` (``full``: with ``--verify full``, for damage only a
    checksum shows). Without them (the manifest itself is damaged), a build into a new folder."""
    if not model or not collections:
        return (
            "vlfit retrieve index --model MODEL --images FOLDER (or --dataset_name DATA) --output_dir NEW_FOLDER "
            "(the manifest lists what the index holds: without it, build the index again)"
        )
    flags = ["--model", str(model.get("path", "MODEL"))]
    last = collections[-1]
    for key in COLLECTION_KEYS:  # the flags of vlfit retrieve index that open it again
        if last.get(key) is not None:
            flags += [f"--{key}", str(last[key])]
    flags += ["--output_dir", folder]
    if full:
        flags += ["--verify", "full"]
    return "vlfit retrieve index " + " ".join(shlex.quote(flag) for flag in flags)


__all__ = [
    "EmbeddingIndex",
    "check_storage",
    "read_manifest",
    "rebuild_command",
    "refuse_nonfinite",
    "write_index_from_embeddings",
    "write_shard",
]
