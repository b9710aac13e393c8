"""Re-ranking an index's results by the fused tower: the cosine search finds each text query's top K candidates,
BridgeTower's image-text matching head scores the (query, candidate image) pairs, and the candidates are reordered
by that score (``--rerank_score itm``) or by it plus a weight times their cosine (``itm+itc``, the run's saved
weight by default: ``vlfit.inference.rerank_score``). ``vlfit retrieve query --rerank_top_k``,
``vlfit.Index.search(rerank=)`` and ``vlfit serve``'s ``"rerank"`` all re-rank through ``Reranker``, as ``vlfit eval
--rerank_top_k`` does for its pools.

Only the top K change order (best match first, ties in cosine order); what follows them keeps its cosine order.
A candidate whose image cannot be read (its file gone since it was indexed) is not scored: it follows the scored
ones, keeps its cosine score and has no ``match_score``. Image queries are not re-ranked: the matching head scores a
caption against an image.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from vlfit.data.image_inputs import ImageBatch, ImageInputs, collate_images
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.index.items import IndexedItems
from vlfit.index.search import Hit
from vlfit.index.store import EmbeddingIndex
from vlfit.index.verify import manifest_stamp
from vlfit.inference.pair_scorer import NO_HEAD_ADVICE, NoMatchingHeadError, PairScorer
from vlfit.inference.rerank_score import ITM_ONLY, RerankScore
from vlfit.inference.runtime import ModelRuntime

logger = logging.getLogger(__name__)

# The most (query, candidate) pairs scored in one call: a batch of queries is split by query, never within one.
PAIRS_PER_CALL = 256
UNREACHABLE_IMAGES = (
    "re-ranking reads the candidates' images, and this index cannot reach them (its items come from tar shards at "
    "URLs, which are not fetched again, or from a dataset that moved); search without it"
)


def check_rerank_top_k(top_k: int | None, flag: str = "--rerank_top_k") -> None:
    """Raises ``ConfigError`` naming ``flag`` unless ``top_k`` is None (no re-ranking) or a whole number >= 1."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"{flag} must be a whole number of candidates, at least 1, got {top_k!r}")


def rerank_problem(scorer: PairScorer | None, items: IndexedItems, model: str) -> str | None:
    """Why ``model`` (its name as the reader should see it) with ``scorer`` (None: it has no matching head) cannot
    re-rank the index of ``items``; None when it can. The one statement of re-ranking's preconditions."""
    if scorer is None:
        return f"{model} has no image-text matching head; {NO_HEAD_ADVICE}"
    return None if items.has_images else UNREACHABLE_IMAGES


def rerankable_items(index: EmbeddingIndex) -> IndexedItems:
    """Where the items' images of ``index`` are, refused in one line when it cannot reach them: ``vlfit retrieve
    query --rerank_top_k`` asks before the model opens (and asks the model for its head before any query runs).

    Raises:
        ConfigError: when the index cannot reach its items' images (``rerank_problem``).
    """
    items = IndexedItems(index, manifest_stamp(index.path))
    if not items.has_images:
        raise ConfigError(UNREACHABLE_IMAGES)
    return items


class Reranker:
    """Re-ranks the hits of text queries by a pair scorer over the indexed items' images.

    Args:
        scorer: The matching head (``vlfit.inference.pair_scorer``).
        items: Where the items' images are.
        images: The model's image path (``ModelRuntime.image_inputs``), which makes the candidates' batches.
    """

    def __init__(self, scorer: PairScorer, items: IndexedItems, images: ImageInputs) -> None:
        self.scorer = scorer
        self.items = items
        self.images = images

    @classmethod
    def beside(cls, runtime: ModelRuntime, index: EmbeddingIndex, items: IndexedItems | None = None) -> Reranker:
        """The re-ranker of an index searched through ``runtime``: its model's matching head, on the same backend,
        precision and threads.

        Raises:
            NoMatchingHeadError: when the model has no matching head (or its export no ``itm`` graph).
            ConfigError: when the index cannot reach its items' images (tar shards at URLs, a dataset moved).
        """
        scorer = runtime.pair_scorer
        items = items if items is not None else IndexedItems(index, manifest_stamp(index.path))
        problem = rerank_problem(scorer, items, runtime.path)
        if problem is not None:
            raise (NoMatchingHeadError if scorer is None else ConfigError)(problem)
        return cls(scorer, items, runtime.image_inputs)

    def rerank(
        self,
        hits: Sequence[list[Hit]],
        texts: Sequence[str],
        top_k: int | Sequence[int | None],
        k: int,
        score: RerankScore | Sequence[RerankScore] = ITM_ONLY,
    ) -> list[list[Hit]]:
        """Each query's hits with its first ``top_k`` reordered by ``score`` of the matching log-odds of (its text,
        the hit's image) and the hit's cosine, cut to ``k``. The pairs of several queries are scored together
        (``PAIRS_PER_CALL`` at most per call of the scorer; each caption and image runs its unimodal encoder once
        per call).

        Args:
            hits: Each query's hits in cosine order (at least ``min(k, top_k)`` each where the index has them).
            texts: Each query's text.
            top_k: Candidates re-scored per query: one number for all, or one per query (None: not re-ranked).
            k: Hits kept per query.
            score: What a candidate is ordered by (``itm``, or ``itm+itc`` with its weight): one for all, or one
                per query.
        """
        tops = [top_k] * len(hits) if isinstance(top_k, int) else list(top_k)
        scored_by = [score] * len(hits) if isinstance(score, RerankScore) else list(score)
        for top in tops:
            check_rerank_top_k(top)
        heads = [found[: top or 0] for found, top in zip(hits, tops, strict=True)]
        scores: dict[tuple[int, int], float] = {}  # (query, row) -> log-odds
        group: list[int] = []
        for query, head in enumerate(heads):
            if head:
                group.append(query)
            if group and (query == len(heads) - 1 or sum(len(heads[q]) for q in group) >= PAIRS_PER_CALL):
                scores.update(self._score([texts[q] for q in group], [heads[q] for q in group], group))
                group = []
        out = []
        for query, (found, head, by) in enumerate(zip(hits, heads, scored_by, strict=True)):
            final = {hit.row: by(scores[(query, hit.row)], hit.score) for hit in head if (query, hit.row) in scores}
            scored = [hit for hit in head if hit.row in final]
            unscored = [hit for hit in head if hit.row not in final]
            order = sorted(scored, key=lambda hit: -final[hit.row])  # stable: ties keep cosine order
            reranked = [
                dataclasses.replace(hit, match_score=round(scores[(query, hit.row)], 6),
                                    fused_score=round(final[hit.row], 6) if by.fused else None)
                for hit in order
            ]  # fmt: skip
            out.append((reranked + unscored + found[len(head) :])[:k])
        return out

    def _score(self, texts: list[str], heads: list[list[Hit]], queries: list[int]) -> dict[tuple[int, int], float]:
        """The log-odds of each (query, candidate) pair of ``heads`` whose image can be read, in one scorer call."""
        images, position_of = candidate_images(self.images, self.items, [hit for head in heads for hit in head])
        pairs = [
            (number, hit.row) for number, head in enumerate(heads) for hit in head if position_of[hit.row] is not None
        ]
        if images is None:
            return {}
        log_odds = self.scorer.score_pairs(texts, images["pixels"], text_rows=[number for number, _ in pairs],
                                           image_rows=[position_of[row] for _, row in pairs]).tolist()  # fmt: skip
        return {(queries[number], row): score for (number, row), score in zip(pairs, log_odds, strict=True)}


def candidate_images(
    images: ImageInputs, items: IndexedItems, hits: Sequence[Hit]
) -> tuple[ImageBatch | None, dict[int, int | None]]:
    """The batch of the images of ``hits`` (each row once) that can be read, and each row's place in it (None for
    one that cannot, logged: it is not re-ranked); no batch when none can."""
    made, position_of = [], {}
    for hit in hits:
        if hit.row in position_of:
            continue
        try:
            made.append(images(items.image_bytes(hit.row), sample_id=hit.id))
        except (MissingFileError, DataError) as err:
            logger.warning("%s is not re-ranked: %s", hit.id, err)
            position_of[hit.row] = None
        else:
            position_of[hit.row] = len(made) - 1
    return (collate_images(made) if made else None), position_of


__all__ = ["PAIRS_PER_CALL", "Reranker", "candidate_images", "check_rerank_top_k", "rerankable_items"]
