"""Keeps an index folder's ANN structure (``ann.faiss``, ``vlfit.index.ann``) covering exactly its shards.

The shards are the store of record; the ANN structure is derived from them, in row order. After a build,
``update_ann`` brings it up to date: it extends the one on disk when that still fits (the same type, its rows a
prefix of the shards' rows: appends only add rows; an IVF index not yet grown past ``RETRAIN_GROWTH`` times what it
was trained on), and builds a new one otherwise. Either way the search parameter is tuned again on the whole
collection. The order of writes keeps a reader safe: the manifest drops its ``ann`` entry before the file is
replaced, ``ann.faiss`` and ``ann.json`` are each written atomically, and the manifest names the new one last.
Each description records the digest of the ids it covers, so a structure left from another collection is never
extended, and the size and SHA-256 of ``ann.faiss``: one that is not the file recorded (cut short, overwritten) is
built again rather than kept or extended.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from vlfit.errors import UserError, full_disk_in_one_line
from vlfit.index.ann import ANN_DESCRIPTION, ANN_FILE, AnnIndex, build_ann
from vlfit.index.ann_choice import (
    DEFAULT_MAX_INDEX_MEMORY,
    IndexChoice,
    choose_index_type,
    rescore_setting,
    storage_choice,
)
from vlfit.index.integrity import check_verify_level, file_problem
from vlfit.index.manifest import IndexManifest, write_manifest
from vlfit.index.store import EmbeddingIndex

logger = logging.getLogger(__name__)


def ids_digest(ids: list[str]) -> str:
    """A digest of the ids in row order: what an ANN structure covers."""
    return hashlib.sha256(json.dumps(ids).encode("utf-8")).hexdigest()[:16]


def _extendable(folder: str, ids: list[str], wanted: IndexChoice) -> AnnIndex | None:
    """The ANN structure on disk, opened for adding, when the shards' rows continue it and it is of the structure
    wanted (the type; for IVF-PQ also the code size, which the memory budget sets)."""
    if not os.path.isfile(os.path.join(folder, ANN_DESCRIPTION)):
        return None
    try:
        ann = AnnIndex.load(folder, mmap=False, what="vlfit retrieve index")
    except UserError as error:
        logger.warning("rebuilding the ANN index: %s", error)
        return None
    covered = len(ann)
    if covered > len(ids) or ann.description.get("ids_digest") != ids_digest(ids[:covered]):
        return None
    if ann.type != wanted.type or ann.description.get("params", {}).get("m") != wanted.params.get("m"):
        return None
    return None if ann.needs_retrain else ann


def update_ann(
    folder: str,
    manifest: IndexManifest | None = None,
    *,
    index_type: str = "auto",
    max_index_memory: int | None = None,
    target_recall: float = 0.95,
    seed: int = 0,
    verify: str = "quick",
    storage: str = "float32",
    rescore: int | None = None,
) -> dict[str, Any]:
    """Make the ANN structure of the index at ``folder`` cover every row of its shards; record it in the manifest.

    Args:
        folder: The index folder.
        manifest: Its manifest as the build left it (``BuiltIndex.manifest``: not read again); None: read it.
        index_type: ``auto``, ``flat``, ``hnsw`` or ``ivfpq``.
        max_index_memory: Bytes the ANN structure may take.
        target_recall: Recall@10 against exact search that the search parameter is tuned to.
        seed: Draws the training and tuning samples.
        verify: How the ANN file on disk is checked before it is kept as it is: ``quick`` its size, ``full`` its
            SHA-256 too (one that differs is built again).
        storage: ``float32``, or a flat scan of ``int8`` or ``binary`` codes (``vlfit.index.ann_choice``).
        rescore: Compact codes: candidates re-scored exactly per result wanted (None: tuned to ``target_recall``).

    Returns:
        The description written to the manifest's ``ann`` (with ``"extended": True`` when rows were added in place);
        empty when the index holds no rows yet.
    """
    check_verify_level(verify)
    index = EmbeddingIndex(folder, manifest)  # a view of the shards the manifest lists now
    manifest, ids, vectors = index.manifest, index.ids(), index.vectors()  # vectors: mapped as they are read
    if not ids:
        return {}
    size = manifest.identity.embedding_size
    compact = storage_choice(len(ids), size, storage, max_index_memory, index_type)
    wanted = compact or choose_index_type(len(ids), size, max_index_memory, index_type)
    budget = DEFAULT_MAX_INDEX_MEMORY if max_index_memory is None else max_index_memory
    current = manifest.ann
    if (
        current
        and current.get("ids_digest") == ids_digest(ids)
        and current.get("type") == wanted.type
        and current.get("target_recall") == target_recall
        and current.get("max_index_memory") == budget
        and (compact is None or current.get("rescore_tuned", False) == (rescore is None))
        and (compact is None or rescore is None or current.get("rerank") == rescore)
        and file_problem(os.path.join(folder, ANN_FILE), current, verify) is None
    ):
        return current  # already covers these rows as asked: the embeddings are not read
    if manifest.ann is not None:  # from here ann.faiss changes: the manifest must not name it meanwhile
        manifest.ann = None
        write_manifest(folder, manifest)
    embeddings = vectors.all_rows()  # float32 [N, D] read from the mapped shards; faiss reads it as is
    ann = _extendable(folder, ids, wanted)
    extended = ann is not None and len(ann) < len(ids)
    if ann is not None:
        ann.add(embeddings[len(ann) :])
        if ann.needs_retrain:
            ann = None
    if ann is None:
        ann = build_ann(embeddings, index_type, max_index_memory, target_recall, seed, storage, rescore)
        extended = False
    else:
        ann.description["max_index_memory"] = budget  # the structure this budget asks for: kept, grown
        if compact is not None:
            ann.description.update(rescore_setting(storage, rescore))
        ann.tune(embeddings, target_recall, seed)
    if not ann.description["reached_target"]:
        logger.warning(
            "the %s index reaches recall@10 %.3f at most, below --target_recall %s: raise --max_index_memory for a "
            "larger structure",
            ann.type,
            ann.description["recall_at_10"],
            target_recall,
        )
    ann.description["ids_digest"] = ids_digest(ids)
    with full_disk_in_one_line(
        folder,
        needed=round(len(ids) * wanted.bytes_per_vector),
        note="the index keeps every shard its manifest lists (queries scan them until the ANN structure is written)",
        remedy="free space there and run the same command again to build it",
    ):
        description = ann.save(folder)
    manifest.ann = description
    write_manifest(folder, manifest)
    return {**description, "extended": extended}


def open_ann(index: EmbeddingIndex) -> AnnIndex | None:
    """The ANN structure the manifest of ``index`` names (``EmbeddingIndex.ann``: in memory, re-ranking from its
    shards), or None when it names none or the file on disk is not the one it names (then queries scan the shards)."""
    return index.ann


__all__ = ["ids_digest", "open_ann", "update_ann"]
