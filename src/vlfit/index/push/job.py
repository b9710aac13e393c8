"""Pushing an index to a vector database: ``vlfit retrieve push`` and ``vlfit.Index.push`` both call ``push_index``.

A push is an idempotent upsert in batches. The collection is created on the first push, recording the index's model
(``CollectionRecord``); a later push from an index of another model or embedding size is refused before anything is
written. The ids the collection holds are read once: items already there are skipped (unless ``overwrite``), so a
push that was stopped part-way (killed, a server gone) resumes where it stopped when run again, and a push of an
unchanged index writes nothing. ``delete_missing`` removes the items the index no longer holds (items removed from
their folder since they were indexed, or pushed from another index). Items of the index left out of its searches
(the manifest's ``removed``) are never pushed.

An item is pushed under its id as a search names it, which is unique in the index for all but one case: files of two
indexed folders at the same path relative to each (``2023/x.jpg`` and ``2024/x.jpg`` of an index of both folders
are each ``x.jpg``). Engines differ on a key given twice (one fails, one keeps both, one keeps the last), so a push
of such an index is refused before anything is written, naming the two items. A push reads the shards it writes
items of, so it checks each as ``vlfit retrieve verify --verify full`` does (checksums, finite embeddings) and
refuses a damaged one before writing its items, as verify words it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from vlfit.errors import ConfigError, DataError
from vlfit.index.ann_choice import DEFAULT_RESCORE, STORAGE_RESCORE
from vlfit.index.integrity import DamagedIndexError
from vlfit.index.push.base import CollectionRecord, Items, Target, TargetError, open_target
from vlfit.index.store import EmbeddingIndex
from vlfit.index.verify import shard_problems
from vlfit.inference.identity import shown_source


@dataclass
class PushReport:
    """What a push did.

    Attributes:
        target: The target URI.
        created: Whether the push created the collection.
        pushed: Items written.
        skipped: Items of the index already in the collection (not written again).
        deleted: Items removed from the collection (``delete_missing``).
        total: Items the collection holds after the push.
        seconds: How long the push took.
        storage: For an index of compact codes (``--vector_storage int8`` or ``binary``), the form the engine keeps
            them in, or that the push sends float32 vectors only.
    """

    target: str
    created: bool = False
    pushed: int = 0
    skipped: int = 0
    deleted: int = 0
    total: int = 0
    seconds: float = 0.0
    storage: str = ""

    @property
    def items_per_second(self) -> float:
        return self.pushed / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        """The report as ``vlfit retrieve push --json`` prints it."""
        return {"target": self.target, "created": self.created, "pushed": self.pushed, "skipped": self.skipped,
                "deleted": self.deleted, "total": self.total, "seconds": round(self.seconds, 3),
                "items_per_second": round(self.items_per_second, 1), **({"storage": self.storage} if self.storage
                else {})}  # fmt: skip

    def lines(self) -> list[str]:
        """The report as ``vlfit retrieve push`` prints it."""
        made = " (created)" if self.created else ""
        rate = f" ({self.items_per_second:.0f} items/s)" if self.pushed else ""
        return [
            f"{self.target}{made}: pushed {self.pushed} items in {self.seconds:.1f} s{rate} from one process, "
            f"{self.skipped} already there, {self.deleted} deleted; it holds {self.total} items"
        ] + ([f"{self.target}: {self.storage}"] if self.storage else [])


def item_ids(index: EmbeddingIndex) -> list[str | None]:
    """Each row's id as a push writes it, None for rows removed from the index's searches: as a search names it, an
    image folder's file relative to the folder indexed (the longest indexed folder that holds it), else its stored id.

    Raises:
        DataError: when two rows would be pushed under one id, naming both.
    """
    roots = [os.path.join(c["images"], "") for c in index.manifest.collections if c.get("images")]
    removed = set(index.manifest.removed)
    named: list[str | None] = []
    owners: dict[str, str] = {}
    for stored in index.row_ids:
        root = max((root for root in roots if stored.startswith(root)), key=len, default=None)
        name = stored[len(root) :] if root is not None else stored
        named.append(None if stored in removed else name)
        if stored not in removed and owners.setdefault(name, stored) != stored:
            raise DataError(
                f"--index {index.path}: two items would be pushed under one id, {name!r}: {owners[name]} and "
                f"{stored} (a folder's file is named by its path relative to the folder indexed); index the folders' "
                "common parent into a new index, or each folder into an index of its own pushed to a collection of "
                "its own (#NAME at the end of the URI)"
            )
    return named


def _settings(index: EmbeddingIndex) -> dict:
    """The settings the index was last built with (none for one built before they were recorded)."""
    collections = index.manifest.collections
    return (collections[-1].get("settings") or {}) if collections else {}


def vector_storage(index: EmbeddingIndex) -> str:
    """The ``--vector_storage`` the index was last built with (``float32`` for one built before it was recorded)."""
    return str(_settings(index).get("vector_storage", "float32"))


def rescore(index: EmbeddingIndex) -> int:
    """The re-scoring factor of the index's compact codes: its ANN structure's (tuned, or the ``--rescore`` it was
    built with), else the one recorded, else its storage's first (``vlfit.index.ann_choice.STORAGE_RESCORE``)."""
    ann = index.manifest.ann or {}
    if ann.get("type") in ("int8", "binary") and ann.get("rerank"):
        return int(ann["rerank"])
    return int(_settings(index).get("rescore") or STORAGE_RESCORE.get(vector_storage(index), DEFAULT_RESCORE))


def index_record(index: EmbeddingIndex) -> CollectionRecord:
    """The record a collection pushed from ``index`` keeps: its model identity, model folder and runtime."""
    return CollectionRecord(index.manifest.identity, dict(index.manifest.model))


def check_record(target: Target, recorded: CollectionRecord, record: CollectionRecord) -> None:
    """Refuse a push into a collection of another model, embedding size or metric, naming the target."""
    held, pushed = recorded.identity, record.identity
    elsewhere = "push it to another collection (#NAME at the end of the URI) or drop this one"
    if (held.family, held.embedding_size) != (pushed.family, pushed.embedding_size):
        raise TargetError(
            f"{target.uri.text}: the collection holds {held.family} embeddings of size {held.embedding_size}, the "
            f"index {pushed.family} embeddings of size {pushed.embedding_size}; {elsewhere}"
        )
    if held.checkpoint_sha256 != pushed.checkpoint_sha256:
        raise TargetError(
            f"{target.uri.text}: the collection holds embeddings of {shown_source(held.checkpoint_sha256)}, the index "
            f"of {shown_source(pushed.checkpoint_sha256)}: they are not comparable; {elsewhere}"
        )
    if recorded.metric != record.metric:
        ranks = f"the collection ranks by {recorded.metric}, the index by {record.metric}"
        raise TargetError(f"{target.uri.text}: {ranks}; {elsewhere}")


def _batches(
    index: EmbeddingIndex, names: list[str | None], wanted: set[str], batch_size: int, model: str
) -> Iterator[Items]:
    """The items of ``index`` whose ids (``names``: ``item_ids``) are in ``wanted``, in row order, in batches of
    ``batch_size``."""
    paths = any(c.get("images") for c in index.manifest.collections)  # an image folder's items are its files
    parts: list[tuple[list[int], np.ndarray, list[list[str] | None]]] = []
    held, start = 0, 0
    for number, shard in enumerate(index.manifest.shards):
        count = int(shard["count"])
        offsets = [offset for offset in range(count) if names[start + offset] in wanted]
        if offsets:
            if problems := shard_problems(index, number, "full"):  # the shard is read anyway: its bytes and values
                first = problems[0]
                raise DamagedIndexError(first.file, first.what, first.repair)
            captions = index.shard_captions(shard) or [None] * count
            vectors = index.vectors().shard(number)[offsets]  # one gather per shard
            parts.append(([start + offset for offset in offsets], vectors, [captions[offset] for offset in offsets]))
            held += len(offsets)
        start += count
        while held >= batch_size or (held and number == len(index.manifest.shards) - 1):
            rows = [row for part in parts for row in part[0]]
            vectors = np.concatenate([part[1] for part in parts]).astype(np.float32, copy=False)
            captions = [caption for part in parts for caption in part[2]]
            ids = [names[row] for row in rows]
            take = min(batch_size, held)
            yield Items(ids[:take], np.ascontiguousarray(vectors[:take]), rows[:take], captions[:take],
                        list(ids[:take]) if paths else [None] * take, model)  # fmt: skip
            parts = [(rows[take:], vectors[take:], captions[take:])] if held > take else []
            held -= take


def push_index(
    index: EmbeddingIndex,
    to: str,
    *,
    overwrite: bool = False,
    delete_missing: bool = False,
    batch_size: int | None = None,
    progress: bool = False,
) -> PushReport:
    """Push ``index`` to the vector database ``to`` (a URI of ``vlfit.index.push.base``), as the module says.

    Args:
        index: The index (opened by ``vlfit.index.verify.open_index``: whole).
        to: The target URI.
        overwrite: Write every item, also those already in the collection.
        delete_missing: Remove items of the collection the index does not hold.
        batch_size: Items per write (None: the engine's ``Target.BATCH_SIZE``).
        progress: Show a progress bar.

    Raises:
        ConfigError: for a ``batch_size`` below 1 or a URI of no known form.
        MissingExtraError: when the target's extra is not installed.
        DataError: when two items of the index would be pushed under one id (``item_ids``).
        DamagedIndexError: before writing the items of a shard whose files differ from what the manifest records
            (checksums) or hold NaN or infinite embeddings, naming the file and the command that rebuilds it.
        TargetError: when the target cannot be reached, holds a collection of another shape, or of another model.
    """
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, got {batch_size}")
    names = item_ids(index)
    live = {name for name in names if name is not None}
    started = time.perf_counter()
    target = open_target(to)
    batch_size = batch_size or target.BATCH_SIZE
    report = PushReport(to)
    target.storage, target.rescore = vector_storage(index), rescore(index)
    record = index_record(index)
    with target.failing("reading the collection"):
        recorded = target.record()
        report.storage = target.storage_note()
    if recorded is None:
        with target.failing("creating the collection"):
            target.create(record)
        report.created = True
        present: set[str] = set()
    else:
        check_record(target, recorded, record)
        with target.failing("reading the ids of the collection"):
            present = target.ids()
    wanted = live if overwrite else live - present
    report.skipped = len(live) - len(wanted)
    bar = tqdm(total=len(wanted), unit="item", desc=f"push {to}", disable=not progress)
    try:
        for items in _batches(index, names, wanted, batch_size, record.identity.checkpoint_sha256):
            with target.failing(f"writing {len(items)} items"):
                target.write(items, new=not (present & set(items.ids)))
            report.pushed += len(items)
            bar.update(len(items))
    finally:
        bar.close()
    with target.failing("indexing the collection"):
        target.finish()
    if delete_missing:
        gone = sorted(present - live)
        for start in range(0, len(gone), batch_size):
            with target.failing("deleting items the index does not hold"):
                target.delete(gone[start : start + batch_size])
        report.deleted = len(gone)
    with target.failing("counting the collection"):
        report.total = target.count()
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["PushReport", "check_record", "index_record", "item_ids", "push_index", "rescore", "vector_storage"]
