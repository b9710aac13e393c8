"""What ``vlfit serve`` serves: the model, loaded once, and a snapshot of the index it answers from.

A snapshot is one manifest's index, checked against its manifest as it opens (``--verify``: ``quick``, every file
there with its recorded size, or ``full``, checksums and finite embeddings too; ``vlfit.index.verify``): the item
ids, the ANN structure the manifest names (read into memory and checked against its recorded checksum, so a file
replaced or overwritten underneath cannot take the server down) or else the embeddings themselves for an exact
scan, and for items of a dataset split their captions (every caption of the image, as the index stores them; an
index built before items had captions: the record's, from the dataset) and where their images are; it answers as
``vlfit retrieve query`` does, removed items left out. Results are ``Hit.to_json``'s, as ``vlfit retrieve query
--json`` prints them: ``id`` the item's id, ``row`` its row in the index (stable while the index grows: appends only
add rows), so ``GET /api/image/{row}`` looks an image up by that number and never opens a path taken from a request.

Reloads are atomic: a new snapshot is built beside the one being served (from the manifest as it was read, which
names only shards already written: ``vlfit retrieve index`` writes each shard before the manifest that lists it)
and replaces it in one assignment; requests in flight finish on the snapshot they started with. A manifest that
cannot be read (half-written by another tool, or gone), or an index that fails its check, leaves the served
snapshot as it is, and so does damage in place to the files it was read from (a shard truncated or replaced while
the manifest stays: each check stats them, and a file changed since is checked against its recorded size and
checksum once per change). Either way the server is degraded: ``SearchEngine.description`` says
``"status": "degraded"`` and the ``"reason"`` in one line (files relative to the index's folder unless
``absolute_paths``), one warning is logged per reason, naming the file and the command that rebuilds it, and a
refused manifest is tried again only once it or the file it was refused for changes. Once the index is whole again
(a reload serves it, or the damaged file is restored), the status is ``ok`` and the reason goes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vlfit.errors import ConfigError, first_line
from vlfit.index.integrity import DamagedIndexError, file_problem
from vlfit.index.items import IndexedItems
from vlfit.index.manifest import MANIFEST_NAME
from vlfit.index.rerank import Reranker, rerank_problem
from vlfit.index.search import Hit, query_runtime, search
from vlfit.index.stages import StageTimes
from vlfit.index.verify import manifest_stamp, open_index, recorded_files
from vlfit.inference.rerank_score import FUSED, ITM_ONLY, RerankScore, check_rerank_weight
from vlfit.inference.runtime_settings import RuntimeSettings

logger = logging.getLogger(__name__)

MAX_K = 1000
MAX_RERANK = 100  # candidates one query may have re-scored by the matching head: each is a pass of the fused tower


class Snapshot:
    """One manifest's index, in memory.

    Args:
        folder: The index folder.
        verify: How its files are checked against the manifest: ``quick`` or ``full`` (``vlfit.index.verify``).
        verified: The manifest stamp ``vlfit.index.verify.verified_stamp`` returned: while the manifest still has
            it, the index is opened without checking it again (a changed manifest, a rebuilt index, is checked).

    Raises:
        MissingFileError: when the folder holds no index.
        DamagedIndexError: naming the first damaged file and the command that rebuilds it.
    """

    def __init__(self, folder: str, verify: str = "quick", verified: tuple[int, int] | None = None) -> None:
        self.stamp = manifest_stamp(folder)
        self.index = index = open_index(folder, verify, verified)
        # Every file the manifest names, with what it records of it and how it was on disk once read: a later stat
        # that differs is a file changed in place (``SearchEngine.reload_if_changed`` checks it then).
        self.files = recorded_files(index)
        self.file_stamps = {path: file_stamp(path) for path in self.files}
        self.manifest = index.manifest
        # Read now, not by the first query: what every search of this snapshot reads (vlfit.index.search).
        self.items: list[str] = index.row_ids
        self.removed_rows = index.left_out_rows  # files gone from their folder (re-indexed since)
        # The ANN structure when the manifest names one (in memory, its checksum checked as it was read), else every
        # embedding, held in memory and scanned exactly.
        self.ann = index.ann
        self.embeddings = index.hold_embeddings() if self.ann is None else None
        if self.embeddings is not None and not bool(torch.isfinite(self.embeddings).all()):
            broken = int((~torch.isfinite(self.embeddings).all(dim=1)).sum())
            logger.warning(
                "%s: %d embeddings hold NaN or infinite values and are left out of results; "
                "vlfit retrieve verify --index %s --verify full names their files",
                folder,
                broken,
                folder,
            )
        self.indexed = IndexedItems(index, self.stamp)  # where items' images are (and an older index's record captions)

    @property
    def search_kind(self) -> str:
        """``exact``, or the ANN structure's type."""
        return "exact" if self.ann is None else self.ann.type

    def __len__(self) -> int:
        return len(self.items)

    def served(self, hit: Hit) -> dict[str, object]:
        """A hit as the server answers it: ``Hit.to_json`` (``id`` the item's id, ``row`` what ``GET /api/image/{row}``
        takes, ``match_score`` when it was re-ranked), with ``item`` (the id, or an image folder's file: ``_shown``
        says how it is shown), ``path`` its file (items of an image folder), ``captions`` all of the image's captions
        (an index built before items had captions: the record's, from the dataset) and ``caption`` the first."""
        captions = hit.captions
        if captions is None and self.indexed.captions.get(hit.id) is not None:
            captions = [self.indexed.captions[hit.id]]  # type: ignore[list-item]
        return {**hit.to_json(), "item": hit.path or hit.id, "path": hit.path,
                "caption": captions[0] if captions else None, "captions": captions}  # fmt: skip

    def search(self, queries: torch.Tensor, k: int) -> list[list[Hit]]:
        """The ``k`` best items for each query embedding ``[Q, D]``, best first (fewer when the index is smaller):
        ``vlfit retrieve query``'s search, items removed from their folder left out."""
        return search(self.index, queries, k)

    def image_bytes(self, row: int) -> bytes:
        """The encoded image of the item at ``row`` (``IndexedItems.image_bytes``).

        Raises:
            MissingFileError: for a row that is not in the index, or an image that is no longer there.
        """
        return self.indexed.image_bytes(row)


class SearchEngine:
    """The model and the served snapshot of one index.

    Args:
        index: The index folder.
        model: A model or exported folder to embed queries with (default: the one the index was built with, on
            the runtime it was built with).
        settings: How the model runs (``None``: every setting as the index was built; ``query_runtime``); its
            runtime threads never spin-wait here.
        search_threads: faiss's OpenMP threads in this process. One by default: the server's concurrency comes
            from batching, and idle OpenMP threads spin on cores the event loop and the encoder need (searching a
            batch of 8 on a busy 2-core machine: 12 ms with 2 threads, 1 ms with 1).
        verify: How the index's files are checked as each snapshot opens: ``quick`` or ``full``.
        absolute_paths: Show results' files and the index and model as absolute paths (for local use); by
            default files relative to the folder indexed, the index and model by name.
        verified: The manifest stamp at which the index was checked already (``vlfit.index.verify.verified_stamp``):
            the first
            snapshot skips its check while the manifest keeps it; reloads check as ever.
        rerank_score, rerank_weight: What re-ranked queries are ordered by when they do not say
            (``--rerank_score``, ``--rerank_weight``; None: the run's saved weight, ``ModelRuntime.rerank_score``).

    Raises:
        MissingFileError: when the folder holds no index.
        DamagedIndexError: naming the first damaged file of the index and the command that rebuilds it.
        RefusedModelError: when ``model`` embeds into another space than the index.
    """

    def __init__(
        self,
        index: str,
        model: str | None = None,
        settings: RuntimeSettings | None = None,
        *,
        search_threads: int = 1,
        verify: str = "quick",
        absolute_paths: bool = False,
        verified: tuple[int, int] | None = None,
        rerank_score: str | None = None,
        rerank_weight: float | None = None,
    ) -> None:
        check_rerank_weight(rerank_weight)  # before the index and the model load
        _set_search_threads(search_threads)
        self.absolute_paths = absolute_paths
        self.folder = index
        self.verify = verify
        self.snapshot = Snapshot(index, verify, verified)
        # Spinning runtime threads would take the cores the event loop parses and answers requests on.
        settings = replace(settings or RuntimeSettings(), allow_spinning=False)
        self.runtime = query_runtime(self.snapshot.index, model, settings)
        self.encoder = self.runtime.encoder
        # The matching head, when the model has one: on the encoder's backend, precision and threads.
        self.pair_scorer = self.runtime.pair_scorer
        self.rerank_by = self.runtime.rerank_score(rerank_score, rerank_weight)  # a query's "rerank_score" aside
        self.rerank_weight = rerank_weight if rerank_weight is not None else self.runtime.saved_rerank_weight
        self.generation = 1
        self._reload_lock = threading.Lock()
        self._damage: DamagedServing | None = None  # why the index on disk is not what is served (None: it is)
        self._refused: tuple[object, ...] | None = None  # what the last refused manifest was refused at
        self._changed_files: dict[str, tuple[tuple[int, int, int] | None, str | None]] = {}  # stamp, problem

    @property
    def description(self) -> dict[str, object]:
        snapshot = self.snapshot
        encoder = self.encoder
        model = encoder.description
        index = os.path.abspath(self.folder)
        if not self.absolute_paths:  # names, not the server's directories
            index = os.path.basename(index)
            model = model.replace(encoder.model_path, os.path.basename(encoder.model_path.rstrip(os.sep)), 1)
        damage = self._damage  # why the index on disk is not what is served: the server is degraded
        status = {"status": "degraded", "reason": self._hide_paths(damage.shown)} if damage else {"status": "ok"}
        by = self.rerank_by  # what a re-ranked search that does not say is ordered by
        return {"index": index, "items": len(snapshot), "search": snapshot.search_kind, "model": model,
                "rerank": self.rerank_problem() is None, "rerank_score": by.kind,
                "rerank_weight": by.weight if by.fused else None, "generation": self.generation, **status}  # fmt: skip

    def _hide_paths(self, text: str) -> str:
        """``text`` with the index's folder and the model's named as ``description`` names them."""
        if self.absolute_paths:
            return text
        for path in (os.path.abspath(self.folder), self.encoder.model_path.rstrip(os.sep)):
            text = text.replace(path, os.path.basename(path))
        return text

    def rerank_problem(self) -> str | None:
        """Why the served model and index cannot re-rank (None: they can); the model unnamed, as paths are hidden."""
        return rerank_problem(self.pair_scorer, self.snapshot.indexed, "this server's model")

    def check_rerank(self, rerank: int | None, score: str | None = None) -> RerankScore:
        """What a query re-ranks by: its ``"rerank_score"`` (None: the server's, ``--rerank_score``).

        Raises:
            ConfigError: unless ``rerank`` is None (and ``score`` too), or 1..``MAX_RERANK`` and re-ranking is
                available; for ``itm+itc`` on a server without a weight.
        """
        if rerank is None:
            if score is not None:
                raise ConfigError('"rerank_score" orders the re-ranked candidates: add "rerank": K, or drop it')
            return self.rerank_by
        if not 1 <= rerank <= MAX_RERANK:
            raise ConfigError(f'"rerank" must be between 1 and {MAX_RERANK} candidates, got {rerank}')
        problem = self.rerank_problem()
        if problem is not None:
            raise ConfigError(f"cannot re-rank: {problem}")
        if score is None:
            return self.rerank_by
        if score != FUSED:
            return ITM_ONLY
        if self.rerank_weight is None:
            raise ConfigError('"rerank_score": "itm+itc" needs a weight and this server has none: its model saved '
                              'none (rerank.json) and vlfit serve was started without --rerank_weight')  # fmt: skip
        return RerankScore(FUSED, self.rerank_weight)

    def reload_if_changed(self) -> bool:
        """Serve the index's current manifest if it changed since the snapshot was read; True when it did.

        A manifest that cannot be read, an index that fails its check (``verify``), or an index now built with
        another model, keeps the served snapshot, and so do files of the served snapshot damaged in place; the
        server is degraded meanwhile (``description``), with one warning logged per reason."""
        with self._reload_lock:  # one reload at a time; searches go on meanwhile
            stamp = manifest_stamp(self.folder)
            if stamp == self.snapshot.stamp:
                self._set_damage(self._damage_in_place())
                return False
            if stamp is None:
                missing = f"{os.path.abspath(os.path.join(self.folder, MANIFEST_NAME))}: missing"
                self._set_damage(DamagedServing(f"index {self.folder} cannot be served ({missing})", missing))
                return False
            if self._refused is not None and self._refused == _refusal(stamp, self._refused[1]):
                return False  # nothing changed since the manifest was refused: the same reason stands
            try:
                fresh = Snapshot(self.folder, self.verify)
                self.encoder.check_embeds_into(fresh.index.manifest.identity, f"the index {fresh.index.path}")
            except Exception as err:  # noqa: BLE001 - whatever broke the new manifest, the old snapshot serves on
                damaged = err if isinstance(err, DamagedIndexError) else None
                self._refused = _refusal(stamp, damaged.file if damaged else None)
                why = first_line(err)
                shown = f"{os.path.abspath(damaged.file)}: {damaged.problem}" if damaged else why
                self._set_damage(DamagedServing(f"index {self.folder} changed but cannot be served ({why})", shown))
                return False
            self._refused = None
            self._changed_files = {}
            self.snapshot = fresh  # one assignment: a request sees the old snapshot or the new one, whole
            self.generation += 1
            logger.info("serving %s: %d items (generation %d)", self.folder, len(fresh), self.generation)
            self._set_damage(None)
            return True

    def _damage_in_place(self) -> DamagedServing | None:
        """The first file of the served snapshot changed on disk since it was read and now damaged; each changed
        file is checked once per change (its size and checksum against the manifest), a stat per file otherwise."""
        snapshot = self.snapshot
        for path, recorded in snapshot.files.items():
            stamp = file_stamp(path)
            if stamp == snapshot.file_stamps[path]:
                continue
            checked = self._changed_files.get(path)
            if checked is None or checked[0] != stamp:
                checked = self._changed_files[path] = (stamp, file_problem(path, recorded, "full"))
            problem = checked[1]
            if problem is not None:
                shown = f"{os.path.abspath(path)}: {problem}"
                repair = snapshot.index.rebuild_command(full=True)
                return DamagedServing(f"index {self.folder} damaged in place ({shown}; rebuild it: {repair})", shown)
        return None

    def _set_damage(self, damage: DamagedServing | None) -> None:
        """Record why the server is degraded (None: it is not), logging each new reason once."""
        before, self._damage = self._damage, damage
        if damage is not None and (before is None or before.logged != damage.logged):
            logger.warning("%s; serving generation %d as it was read", damage.logged, self.generation)
        elif damage is None and before is not None:
            logger.info("index %s is whole again: serving generation %d", self.folder, self.generation)

    def encode_texts(self, texts: Sequence[str], times: StageTimes | None = None) -> torch.Tensor:
        """L2-normalized float32 embeddings ``[N, D]`` of captions (256 at a time, as ``vlfit.Model`` embeds);
        ``times`` gets the ``encode`` time."""
        with (times or StageTimes()).stage("encode"):
            return self.runtime.embed_texts(list(texts), 256).contiguous()

    def encode_image(self, image: bytes, times: StageTimes | None = None) -> torch.Tensor:
        """The embedding ``[1, D]`` of encoded image bytes; ``times`` gets the ``decode`` (bytes to pixels) and
        ``encode`` (the image tower) times apart.

        Raises:
            DataError: naming why the bytes are not an image the pipeline can decode.
        """
        times = times or StageTimes()
        with times.stage("decode"):
            pixels = self.runtime.image_batch(bytes(image))  # DataError names images[0] and why
        with times.stage("encode"):
            return self.encoder.encode_images(**pixels).float().contiguous()

    def search(
        self,
        queries: torch.Tensor,
        k: int,
        texts: Sequence[str] = (),
        rerank: Sequence[int | None] = (),
        times: StageTimes | None = None,
        scores: Sequence[RerankScore] = (),
    ) -> list[list[dict[str, object]]]:
        """The served snapshot's results as the server answers them (``Snapshot.served``), all from one snapshot
        (``k`` and ``rerank`` are checked by the caller, ``check_k`` and ``check_rerank``, before any batching).
        Queries with a ``rerank`` have that many candidates re-scored by the matching head (their ``texts``), all
        the batch's pairs together, each ordered by its ``scores`` (``check_rerank``'s; default: the server's).
        ``times`` gets the ``search`` and ``rerank`` times."""
        times = times or StageTimes()
        snapshot = self.snapshot  # a reload meanwhile does not mix two snapshots in one answer
        tops = [top or 0 for top in rerank]
        with times.stage("search"):
            found = snapshot.search(queries, max([k, *tops]))
        if any(tops):
            with times.stage("rerank"):
                by = list(scores) or [self.rerank_by] * len(found)
                reranker = Reranker(self.pair_scorer, snapshot.indexed, self.runtime.image_inputs)
                found = reranker.rerank(found, texts, rerank, max([k, *tops]), by)
        return [[self._shown(snapshot.served(hit)) for hit in hits[:k]] for hits in found]

    def _shown(self, result: dict[str, object]) -> dict[str, object]:
        """``result`` with its file shown relative to the indexed folder it came from (``absolute_paths``: as it
        is): a client learns nothing of the server's directories."""
        path = result["path"]
        if self.absolute_paths or not isinstance(path, str):
            return result
        roots = [c["images"] for c in self.snapshot.manifest.collections if c.get("images")]
        root = next((r for r in roots if path.startswith(os.path.join(r, ""))), None)
        shown = os.path.relpath(path, root) if root is not None else os.path.basename(path)
        return {**result, "path": shown, "item": shown}


@dataclass(frozen=True)
class DamagedServing:
    """Why the index on disk is not what the server serves: ``logged`` the warning's words (the file and, for a
    damaged one, the command that rebuilds it), ``shown`` the ``reason`` clients get (the file and what is wrong)."""

    logged: str
    shown: str


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """``(inode, size, mtime_ns)`` of ``path``: another value is a file changed or replaced; None when it is gone."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _refusal(stamp: tuple[int, int], file: str | None) -> tuple[object, ...]:
    """What a manifest was refused at: its stamp, and the file it was refused for with that file's stamp (a reload
    tries again once either changes)."""
    return stamp, file, file_stamp(file) if file else None


def _set_search_threads(threads: int) -> None:
    try:
        import faiss
    except ImportError:  # no ANN structure can be served: exact scans run on torch
        return
    faiss.omp_set_num_threads(threads)


def check_k(k: int) -> None:
    """Raises ``ConfigError`` unless ``1 <= k <= MAX_K``."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise ConfigError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
