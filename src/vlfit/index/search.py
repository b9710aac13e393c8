"""The one search of an index, and its one hit type: ``vlfit retrieve query``, ``vlfit.Index.search`` and
``vlfit serve`` all answer through ``search``.

Queries (text or image, embedded by the index's model) are answered by the index's ANN structure when the manifest
names one, else exactly: top-k by chunks, shard by shard (or over the embeddings a server holds in memory). The
exact scan never holds the index whole: each shard's top k comes from ``chunked_topk`` (at most ``chunk_elements``
scores at once) and is merged into the running top k, so a million-embedding index costs one shard and one chunk.
The ANN structure (``EmbeddingIndex.ann``) is read into memory, checked against its recorded checksum. Either way,
items removed from their folder since they were indexed (the manifest's ``removed``) are left out, and so are rows
whose embeddings are not finite (NaN or infinite: an index written before vlfit refused them, or damaged since;
``vlfit retrieve verify --verify full`` names them): no score that is not a number reaches a result. Results have
the same form: a ``Hit`` per item (its id, row, cosine score and captions), best first. Query embeddings stay torch
tensors (what the encoders give) up to faiss, which reads them as a numpy view without a copy.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlfit.errors import DataError
from vlfit.index.store import EmbeddingIndex
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.inference.topk import DEFAULT_CHUNK_ELEMENTS, chunked_topk


@dataclass(frozen=True)
class Hit:
    """One result of a search (``vlfit.SearchHit``): the item's id (an image folder's file as a path relative to
    the folder indexed, or the dataset image's id), its cosine score, its captions when the index stores them (every
    caption of the image, for a dataset split's items), its row in the index (stable while the index grows; what
    ``vlfit serve``'s ``GET /api/image/{row}`` takes), when re-ranked (``vlfit.index.rerank``) the matching head's
    log-odds of the query and its image (and, re-ranked by ``itm+itc``, the ``fused_score`` it was ordered by), and
    an image folder's file (``path``, absolute)."""

    id: str
    score: float
    captions: list[str] | None = None
    row: int = -1
    match_score: float | None = None
    path: str | None = None
    fused_score: float | None = None

    def to_json(self) -> dict[str, object]:
        """The hit as ``vlfit retrieve query --json``, ``vlfit serve``'s ``/api/search`` and the Python API give it:
        ``{"id", "row", "score"}``, ``"match_score"`` when re-ranked (and ``"fused_score"`` by ``itm+itc``),
        ``"captions"`` when the index stores some."""
        shown: dict[str, object] = {"id": self.id, "row": self.row, "score": self.score}
        if self.match_score is not None:
            shown["match_score"] = self.match_score
        if self.fused_score is not None:
            shown["fused_score"] = self.fused_score
        return shown if self.captions is None else {**shown, "captions": self.captions}


def query_runtime(
    index: EmbeddingIndex, model: str | None = None, settings: RuntimeSettings | None = None
) -> ModelRuntime:
    """The runtime that embeds an index's queries (``vlfit retrieve query``, ``vlfit serve``, ``vlfit.Index``):
    ``model`` with ``settings``, or without a model the one the index was built with, each setting left unset taken
    from how it was built (``RuntimeSettings.as_built``), so queries and items are embedded alike.

    Raises:
        ConfigError: for an ``embedding_dim`` other than the size the index holds.
        vlfit.inference.identity.RefusedModelError: when ``model`` embeds into another space than the index.
    """
    settings = settings or RuntimeSettings()
    index.manifest.check_embedding_dim(settings.embedding_dim, index.path)
    if model is None:
        model, settings = index.manifest.model["path"], settings.as_built(index.manifest.model)
    runtime = ModelRuntime.open(model, settings)
    runtime.encoder.check_embeds_into(index.manifest.identity, f"the index {index.path}")
    return runtime


def search(
    index: EmbeddingIndex,
    queries: torch.Tensor,
    k: int,
    *,
    exact: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> list[list[Hit]]:
    """The ``k`` best items of the index for each query embedding, best first (fewer when fewer items are left).

    What the index reads to answer (its ids, removed rows, ANN structure, captions; the embeddings when
    ``hold_embeddings`` was called) is read once per ``EmbeddingIndex`` and kept for the next queries.

    Args:
        index: The index.
        queries: ``[Q, D]`` embeddings from the index's model.
        k: Results per query.
        exact: Scan the shards even when the index has an ANN structure.
        chunk_elements: Largest number of scores held at once (exact scan).

    Raises:
        DataError: when a query embedding holds NaN or infinite values (the model's output: nothing to rank by).
    """
    ids, removed = index.row_ids, index.left_out_rows
    wanted = min(k, len(ids) - len(removed))
    if wanted <= 0:
        return [[] for _ in range(queries.shape[0])]
    queries = queries.float().contiguous()
    broken = (~torch.isfinite(queries).all(dim=1)).nonzero().flatten().tolist()
    if broken:
        raise DataError(
            f"the model embeds query {broken[0]} to NaN or infinite values: nothing to rank by (its weights or "
            "inputs are broken: a diverged fine-tune?)"
        )
    ann = None if exact else index.ann
    if ann is not None:
        scores, rows = ann.search(queries.numpy(), wanted, exclude=removed)  # a view of the tensor: no copy
        scores, rows = torch.from_numpy(scores), torch.from_numpy(rows)
    else:
        scores, rows = _exact_search(index, queries, wanted, chunk_elements)
    captions = index.item_captions()
    roots = [os.path.join(c["images"], "") for c in index.manifest.collections if c.get("images")]
    return [
        [
            Hit(
                _item_id(ids[row], roots),
                round(score, 6),
                captions.get(ids[row]) if captions else None,
                row,
                path=ids[row] if roots and os.path.isabs(ids[row]) else None,
            )
            for score, row in zip(row_scores, row_rows, strict=True)
            if row >= 0 and math.isfinite(score)  # an ANN structure over embeddings that are not finite
        ]
        for row_scores, row_rows in zip(scores.tolist(), rows.tolist(), strict=True)
    ]


def _item_id(stored: str, roots: Sequence[str]) -> str:
    """An item's id as results name it: an image folder's file (stored by its absolute path) relative to the
    folder indexed (``roots``, each ending in a separator; the longest that holds it), else its stored id."""
    root = max((root for root in roots if stored.startswith(root)), key=len, default=None)
    return stored[len(root) :] if root is not None else stored


def _exact_search(
    index: EmbeddingIndex, queries: torch.Tensor, k: int, chunk_elements: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [Q, k], rows [Q, k])`` of the ``k`` best rows not removed (``k`` at most the rows left), by a scan
    of each shard merged into the running top k. A shard whose top scores are not finite has rows whose embeddings
    are not (a NaN sorts first): it is scanned again without them."""
    removed = index.left_out_rows
    best_scores = torch.empty(queries.shape[0], 0)
    best_rows = torch.empty(queries.shape[0], 0, dtype=torch.long)
    start = 0
    for shard_ids, embeddings in index.scanned_shards():
        count, first = len(shard_ids), start
        start += count
        gone = torch.tensor(removed[bisect_left(removed, first) : bisect_left(removed, start)], dtype=torch.long)
        if count == len(gone):
            continue
        # Removed rows may be among the best: ask for that many more, then leave them out (no copy of the shard).
        scores, rows = chunked_topk(queries, embeddings, min(count, k + len(gone)), chunk_elements=chunk_elements)
        if not bool(torch.isfinite(scores).all()):
            broken = (~torch.isfinite(embeddings).all(dim=1)).nonzero().flatten() + first
            gone = torch.unique(torch.cat([gone, broken]))
            if count == len(gone):
                continue
            scores, rows = chunked_topk(queries, embeddings, min(count, k + len(gone)), chunk_elements=chunk_elements)
        rows += first
        if len(gone):
            # Each query keeps at least min(k, count - len(gone)) rows: a stable sort puts them first, in order.
            kept = torch.argsort(torch.isin(rows, gone).to(torch.int8), dim=1, stable=True)[
                :, : min(k, count - len(gone))
            ]
            scores, rows = scores.gather(1, kept), rows.gather(1, kept)
        # Earlier shards first, so a stable sort keeps ties in index order.
        best_scores, order = torch.sort(torch.cat([best_scores, scores], dim=1), dim=1, descending=True, stable=True)
        best_scores, order = best_scores[:, :k], order[:, :k]
        best_rows = torch.cat([best_rows, rows], dim=1).gather(1, order)
    return best_scores, best_rows
