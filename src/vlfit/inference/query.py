"""Queries against an index: text or image queries embedded by the index's model, answered by its ANN structure
when the manifest names one, else exactly, top-k by chunks, shard by shard.

The exact scan never holds the index whole: each shard's top k comes from ``chunked_topk`` (at most
``chunk_elements`` scores at once) and is merged into the running top k, so a million-embedding index costs one shard
and one chunk. The ANN structure (``vlfit.inference.index_ann``) is memory-mapped when it is an IVF index. Either
way, items removed from their folder since they were indexed (the manifest's ``removed``) are left out, and results
have the same form: ids with their cosine scores, best first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlfit.data.records import Record
from vlfit.errors import ConfigError, MissingFileError
from vlfit.inference.backends import Encoder
from vlfit.inference.collection import RecordListSource, host_batches
from vlfit.inference.index import EmbeddingIndex
from vlfit.inference.topk import DEFAULT_CHUNK_ELEMENTS, chunked_topk

if TYPE_CHECKING:
    from vlfit.inference.ann import AnnIndex

# In a file of queries, a line starting with this is an image query (the rest is the image's path).
IMAGE_PREFIX = "image:"


@dataclass(frozen=True)
class Query:
    """A text query, or an image query (``image`` is a file path)."""

    text: str | None = None
    image: str | None = None

    @property
    def description(self) -> str:
        return self.text if self.text is not None else f"{IMAGE_PREFIX}{self.image}"


@dataclass(frozen=True)
class Hit:
    """One result: the item's id, its cosine score, and its captions when the index stores them (every caption of
    the image, for a dataset split's items)."""

    id: str
    score: float
    captions: list[str] | None = None

    def to_dict(self) -> dict[str, object]:
        """``{"id", "score"}``, and ``"captions"`` when there are some."""
        return {
            "id": self.id,
            "score": self.score,
            **({"captions": self.captions} if self.captions is not None else {}),
        }


def read_queries(path: str) -> list[Query]:
    """One query per non-empty line: text, or ``image:PATH``.

    ``PATH`` is taken as typed, as ``--image PATH`` would be: a relative path is relative to the working directory
    (not to the file), and results name it as written.

    Raises:
        MissingFileError: when the file does not exist.
        ConfigError: when it holds no query.
    """
    if not os.path.isfile(path):
        raise MissingFileError(f"--queries {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    queries = []
    for line in lines:
        if not line:
            continue
        if line.startswith(IMAGE_PREFIX):
            image = line[len(IMAGE_PREFIX) :].strip()
            queries.append(Query(image=image))
        else:
            queries.append(Query(text=line))
    if not queries:
        raise ConfigError(f"--queries {path}: no queries in it (one per line: text, or image:PATH)")
    return queries


def embed_queries(encoder: Encoder, queries: Sequence[Query], batch_size: int = 32) -> torch.Tensor:
    """The embeddings ``[Q, D]`` of ``queries`` in order: texts through the text tower, image files through the
    fast CPU pipeline and the image tower.

    Raises:
        FileNotFoundError: for an image file that does not exist.
        ValueError: for an image that cannot be decoded.
    """
    rows: list[torch.Tensor | None] = [None] * len(queries)
    texts = [(i, q.text) for i, q in enumerate(queries) if q.text is not None]
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        embeddings = encoder.embed_texts([text for _, text in chunk])
        for (i, _), row in zip(chunk, embeddings, strict=True):
            rows[i] = row
    images = [(i, q.image) for i, q in enumerate(queries) if q.image is not None]
    if images:
        records = []
        for _, path in images:
            if not os.path.isfile(path):
                raise MissingFileError(f"--image {path}: no such file")
            with open(path, "rb") as f:
                records.append(Record(id=path, image=f.read(), caption=path))
        source = RecordListSource(records, "query images")
        done = 0
        for batch in host_batches(source, encoder.spec, batch_size=batch_size):
            if batch.bad_samples:
                bad = batch.bad_samples[0]
                raise ConfigError(f"--image {bad.id}: cannot be used: {bad.reason}")
            for row in encoder.embed_pixels(batch["pixel_values"]):
                rows[images[done][0]] = row
                done += 1
    return torch.stack([row for row in rows if row is not None])


def search(
    index: EmbeddingIndex,
    queries: torch.Tensor,
    k: int,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    exact: bool = False,
) -> list[list[Hit]]:
    """The ``k`` best items of the index for each query embedding, best first.

    Args:
        index: The index.
        queries: ``[Q, D]`` embeddings from the index's model.
        k: Results per query.
        chunk_elements: Largest number of scores held at once (exact scan).
        exact: Scan the shards even when the index has an ANN structure.
    """
    results = None
    if not exact and index.manifest.ann:
        from vlfit.inference.index_ann import open_ann

        ann = open_ann(index)
        if ann is not None:
            results = _ann_search(index, ann, queries, k)
    if results is None:
        results = _exact_search(index, queries, k, chunk_elements)
    captions = index.item_captions()
    if not captions:
        return results
    return [[Hit(hit.id, hit.score, captions.get(hit.id)) for hit in hits] for hits in results]


def _ann_search(index: EmbeddingIndex, ann: AnnIndex, queries: torch.Tensor, k: int) -> list[list[Hit]]:
    ids = index.ids()
    scores, rows = ann.search(queries.float().numpy(), k, exclude=index.removed_rows(ids))
    return [
        [Hit(ids[row], round(float(score), 6)) for score, row in zip(row_scores, row_rows, strict=True) if row >= 0]
        for row_scores, row_rows in zip(scores.tolist(), rows.tolist(), strict=True)
    ]


def _exact_search(index: EmbeddingIndex, queries: torch.Tensor, k: int, chunk_elements: int) -> list[list[Hit]]:
    removed = set(index.manifest.removed)
    best_scores = torch.empty(queries.shape[0], 0)
    best_ids: list[list[str]] = [[] for _ in range(queries.shape[0])]
    for shard_ids, shard_embeddings in index.shards():
        ids, embeddings = shard_ids, shard_embeddings
        if removed:
            kept = [row for row, item in enumerate(shard_ids) if item not in removed]
            ids, embeddings = [shard_ids[row] for row in kept], shard_embeddings[kept]
        if not ids:
            continue
        scores, rows = chunked_topk(queries, embeddings, k, chunk_elements=chunk_elements)
        merged = torch.cat([best_scores, scores], dim=1)
        candidates = [previous + [ids[r] for r in row] for previous, row in zip(best_ids, rows.tolist(), strict=True)]
        # Earlier shards first, so a stable sort keeps ties in index order.
        best_scores, order = torch.sort(merged, dim=1, descending=True, stable=True)
        best_scores, order = best_scores[:, :k], order[:, :k]
        best_ids = [[row_ids[j] for j in row] for row_ids, row in zip(candidates, order.tolist(), strict=True)]
    return [
        [Hit(item, round(float(score), 6)) for item, score in zip(row_ids, row_scores.tolist(), strict=True)]
        for row_ids, row_scores in zip(best_ids, best_scores, strict=True)
    ]
