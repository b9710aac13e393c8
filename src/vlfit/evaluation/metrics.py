"""Retrieval metrics on similarity matrices and on embeddings. Pure tensor math, tested on hand-built matrices.

On embeddings, the similarity is walked in chunks (``vlfit.evaluation.topk``): a whole split is scored without
building its ``N x N`` matrix.
"""

from __future__ import annotations

import torch

from vlfit.evaluation.topk import DEFAULT_CHUNK_ELEMENTS, true_pair_ranks

RECALL_KS = (1, 5, 10)


def recall_at_k(similarity: torch.Tensor, ks: tuple[int, ...] = RECALL_KS) -> dict[str, float]:
    """Recall@k in both directions for a square similarity matrix whose diagonal holds the true pairs.

    ``similarity[i, j]`` scores text ``i`` against image ``j``. Text->image recall@k is the share of rows whose
    diagonal entry ranks within the top k of the row; image->text does the same on columns. Ties count against
    the true pair (a constant matrix scores chance or below, never a perfect recall).

    Returns:
        ``{"t2i_recall@k": ..., "i2t_recall@k": ...}`` for each k.
    """
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"similarity must be square, got shape {tuple(similarity.shape)}")
    metrics: dict[str, float] = {}
    for name, matrix in (("t2i", similarity), ("i2t", similarity.t())):
        true = matrix.diagonal().unsqueeze(1)
        # Rank = number of candidates scoring at least as high as the true one, excluding itself.
        rank = (matrix >= true).sum(dim=1) - 1
        metrics.update(_recall_from_ranks(name, rank, ks))
    return metrics


def _recall_from_ranks(name: str, rank: torch.Tensor, ks: tuple[int, ...]) -> dict[str, float]:
    return {f"{name}_recall@{k}": (rank < k).float().mean().item() for k in ks}


def embedding_recall_at_k(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    ks: tuple[int, ...] = RECALL_KS,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, float]:
    """``recall_at_k(text_embeds @ image_embeds.T)`` without building that matrix: the ranks come a chunk of
    queries at a time (``true_pair_ranks``), so memory stays at ``chunk_elements`` scores whatever the split's
    size. Same counting (ties against the true pair), same results."""
    if text_embeds.shape[0] == 0:
        raise ValueError("no samples to evaluate")
    metrics: dict[str, float] = {}
    for name, queries, candidates in (("t2i", text_embeds, image_embeds), ("i2t", image_embeds, text_embeds)):
        ranks = true_pair_ranks(queries, candidates, chunk_elements=chunk_elements)
        metrics.update(_recall_from_ranks(name, ranks, ks))
    return metrics


def pooled_recall_at_k(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    pool_size: int | None = None,
    ks: tuple[int, ...] = RECALL_KS,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, float]:
    """Recall@k over consecutive candidate pools of ``pool_size`` pairs (the whole set when ``None``).

    Metrics are averaged over pools weighted by pool size. ``chance_recall@1`` is the expected recall@1 of a
    random ranking (1 / pool size), the number to compare recall@1 against. Each pool is scored in chunks of at
    most ``chunk_elements`` similarities (``embedding_recall_at_k``).
    """
    n = text_embeds.shape[0]
    if n == 0:
        raise ValueError("no samples to evaluate")
    pool_size = n if pool_size is None or pool_size <= 0 else min(pool_size, n)
    totals: dict[str, float] = {}
    chance = 0.0
    for start in range(0, n, pool_size):
        t, i = text_embeds[start : start + pool_size], image_embeds[start : start + pool_size]
        size = t.shape[0]
        for key, value in embedding_recall_at_k(t, i, ks, chunk_elements=chunk_elements).items():
            totals[key] = totals.get(key, 0.0) + value * size
        chance += 1.0
    metrics = {key: value / n for key, value in totals.items()}
    metrics["chance_recall@1"] = chance / n
    metrics["pool_size"] = float(pool_size)
    metrics["num_samples"] = float(n)
    return metrics


def matching_accuracy(image_embeds: torch.Tensor, choice_embeds: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of images whose highest-scoring caption choice is the labelled one.

    Args:
        image_embeds: ``[N, D]``.
        choice_embeds: ``[N, C, D]`` embeddings of each sample's C caption choices.
        labels: ``[N]`` index of the right choice.
    """
    scores = torch.einsum("nd,ncd->nc", image_embeds.float(), choice_embeds.float())
    return (scores.argmax(dim=1) == labels).float().mean().item()
