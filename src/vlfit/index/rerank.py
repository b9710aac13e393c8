"""Re-ranking an index's results by the fused tower: the cosine search finds each text query's top K candidates,
BridgeTower's image-text matching head scores the (query, candidate image) pairs, and the candidates are reordered
by that score. ``vlfit retrieve query --rerank_top_k``, ``vlfit.Index.search(rerank=)`` and ``vlfit serve``'s
``"rerank"`` all re-rank through ``Reranker``, as ``vlfit eval --rerank_top_k`` does for its pools.

Only the top K change order (best match first, ties in cosine order); what follows them keeps its cosine order.
A candidate whose image cannot be read (its file gone since it was indexed) is not scored: it follows the scored
ones, keeps its cosine score and has no ``match_score``. Image queries are not re-ranked: the matching head scores a
caption against an image.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from vlfit.data.image_transforms import FastImageTransform, stack_images
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.index.items import IndexedItems
from vlfit.index.search import Hit
from vlfit.index.store import EmbeddingIndex
from vlfit.inference.backends import Encoder
from vlfit.inference.pair_scorer import NO_HEAD_ADVICE, NoMatchingHeadError, PairScorer, pair_scorer_for

logger = logging.getLogger(__name__)


def check_rerank_top_k(top_k: int | None, flag: str = "--rerank_top_k") -> None:
    """Raises ``ConfigError`` naming ``flag`` unless ``top_k`` is None (no re-ranking) or a whole number >= 1."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"{flag} must be a whole number of candidates, at least 1, got {top_k!r}")


class Reranker:
    """Re-ranks the hits of text queries by a pair scorer over the indexed items' images.

    Args:
        scorer: The matching head (``vlfit.inference.pair_scorer``).
        items: Where the items' images are.
    """

    def __init__(self, scorer: PairScorer, items: IndexedItems) -> None:
        self.scorer = scorer
        self.items = items
        self._transform = FastImageTransform(scorer.spec.image_size)

    @classmethod
    def beside(cls, encoder: Encoder, index: EmbeddingIndex, items: IndexedItems | None = None) -> Reranker:
        """The re-ranker of an index searched with ``encoder``: its model's matching head, on the same runtime.

        Raises:
            NoMatchingHeadError: when the model has no matching head (or its export no ``itm`` graph).
            ConfigError: when the index cannot reach its items' images (tar shards at URLs, a dataset moved).
        """
        scorer = pair_scorer_for(encoder)
        if scorer is None:
            raise NoMatchingHeadError(f"{encoder.model_path} has no image-text matching head; {NO_HEAD_ADVICE}")
        items = items if items is not None else IndexedItems(index)
        if not items.has_images:
            raise ConfigError(
                "re-ranking reads the candidates' images, and this index cannot reach them (its items come from tar "
                "shards at URLs, which are not fetched again, or from a dataset that moved); search without it"
            )
        return cls(scorer, items)

    def rerank(self, hits: Sequence[list[Hit]], texts: Sequence[str], top_k: int, k: int) -> list[list[Hit]]:
        """Each query's hits with its first ``top_k`` reordered by the matching score of (its text, the hit's
        image), cut to ``k``.

        Args:
            hits: Each query's hits in cosine order (at least ``min(k, top_k)`` each where the index has them).
            texts: Each query's text.
            top_k: Candidates re-scored per query.
            k: Hits kept per query.
        """
        check_rerank_top_k(top_k)
        return [self._rerank_one(found, text, top_k)[:k] for found, text in zip(hits, texts, strict=True)]

    def _rerank_one(self, found: list[Hit], text: str, top_k: int) -> list[Hit]:
        head, tail = found[:top_k], found[top_k:]
        pixels, scored, unscored = [], [], []
        for hit in head:
            try:
                pixels.append(self._transform(self.items.image_bytes(hit.row), sample_id=hit.id))
            except (MissingFileError, DataError) as err:
                logger.warning("%s is not re-ranked: %s", hit.id, err)
                unscored.append(hit)
            else:
                scored.append(hit)
        if not scored:
            return found
        count = len(scored)
        log_odds = self.scorer.score_pairs([text], stack_images(pixels), text_rows=[0] * count,
                                           image_rows=list(range(count))).tolist()  # fmt: skip
        order = sorted(range(count), key=lambda i: -log_odds[i])  # stable: ties keep their cosine order
        reranked = [dataclasses.replace(scored[i], match_score=round(log_odds[i], 6)) for i in order]
        return reranked + unscored + tail


__all__ = ["Reranker", "check_rerank_top_k"]
