"""Top-k and the ranks of right answers over embeddings, in chunks: no matrix larger than one chunk is ever built.

Retrieval scores queries ``[Q, D]`` against candidates ``[N, D]`` by dot product (the embeddings are
L2-normalized, so that is the cosine). The full ``Q x N`` matrix of a million-image index, or the ``N x N`` matrix
of a whole evaluation split, does not fit in memory; these functions walk it in blocks of at most
``chunk_elements`` scores and keep only what they return (k scores per query, or one rank per query).

The exact search of an index (``retrieve query``, ``serve``) and evaluation's recall both run on them.
"""

from __future__ import annotations

import torch

# Scores per block: 2**24 float32 values are 64 MiB, big enough that the matrix products stay efficient.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def _block_shape(num_queries: int, num_candidates: int, chunk_elements: int) -> tuple[int, int]:
    """Rows and columns of a block: whole candidate rows when they fit, otherwise one query row at a time."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be at least 1, got {chunk_elements}")
    columns = max(1, min(num_candidates, chunk_elements))
    rows = max(1, min(num_queries, chunk_elements // columns))
    return rows, columns


def chunked_topk(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best candidates of each query by dot product, best first.

    Each block of ``rows x columns`` scores is reduced to its own top k and merged with the running top k, so
    memory is one block plus ``Q x 2k``. Among equal scores the lower candidate index comes first.

    Args:
        queries: ``[Q, D]``.
        candidates: ``[N, D]``.
        k: How many to return per query (at most N are returned).
        chunk_elements: Largest number of scores held at once.

    Returns:
        ``(scores [Q, k'], indices [Q, k'])`` with ``k' = min(k, N)``; indices are int64 rows of ``candidates``.
    """
    if queries.ndim != 2 or candidates.ndim != 2 or queries.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"queries [Q, D] and candidates [N, D] must share D; got {tuple(queries.shape)} and "
            f"{tuple(candidates.shape)}"
        )
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    num_queries, num_candidates = queries.shape[0], candidates.shape[0]
    k = min(k, num_candidates)
    queries, candidates = queries.float(), candidates.float()
    scores = torch.empty(num_queries, k)
    indices = torch.empty(num_queries, k, dtype=torch.long)
    if num_queries == 0 or k == 0:
        return scores, indices
    rows, columns = _block_shape(num_queries, num_candidates, chunk_elements)
    for q_start in range(0, num_queries, rows):
        block_queries = queries[q_start : q_start + rows]
        best_scores = torch.empty(block_queries.shape[0], 0)
        best_indices = torch.empty(block_queries.shape[0], 0, dtype=torch.long)
        for c_start in range(0, num_candidates, columns):
            block = block_queries @ candidates[c_start : c_start + columns].t()
            block_k = min(k, block.shape[1])
            top_scores, top_indices = _stable_topk(block, block_k)
            best_scores = torch.cat([best_scores, top_scores], dim=1)
            best_indices = torch.cat([best_indices, top_indices + c_start], dim=1)
            # Earlier blocks hold lower indices and come first: a stable sort keeps ties in index order.
            best_scores, order = _stable_topk(best_scores, k)
            best_indices = best_indices.gather(1, order)
        scores[q_start : q_start + rows] = best_scores
        indices[q_start : q_start + rows] = best_indices
    return scores, indices


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk`` whose ties keep column order (``torch.topk`` leaves their order unspecified)."""
    sorted_scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
    return sorted_scores[:, :k], order[:, :k]


def target_ranks(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """For each query, how many other candidates score at least as high as its target candidate.

    Text->image retrieval: query ``i`` (a caption) has one right candidate, ``targets[i]`` (its image). Ties count
    against the target (a constant score ranks it last, never first). Computed a block of query rows at a time
    (at least one whole row).

    Args:
        queries: ``[Q, D]``.
        candidates: ``[N, D]``.
        targets: int64 ``[Q]``, the row of ``candidates`` each query belongs with; ``None``: paired rows
            (``Q == N``, query ``i`` belongs with candidate ``i``).
        chunk_elements: Largest number of scores held at once.

    Returns:
        int64 ``[Q]``: 0 when the target is strictly first.
    """
    if queries.ndim != 2 or candidates.ndim != 2 or queries.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"queries [Q, D] and candidates [N, D] must share D; got {tuple(queries.shape)} and "
            f"{tuple(candidates.shape)}"
        )
    if targets is None:
        if queries.shape[0] != candidates.shape[0]:
            raise ValueError(f"paired rows need as many queries as candidates, got {queries.shape[0]} and "
                             f"{candidates.shape[0]}")  # fmt: skip
        targets = torch.arange(queries.shape[0])
    n = queries.shape[0]
    queries, candidates = queries.float(), candidates.float()
    ranks = torch.empty(n, dtype=torch.long)
    rows, _ = _block_shape(n, candidates.shape[0], chunk_elements)
    for start in range(0, n, rows):
        block = queries[start : start + rows] @ candidates.t()
        true = block.gather(1, targets[start : start + rows].unsqueeze(1))
        ranks[start : start + rows] = (block >= true).sum(dim=1) - 1
    return ranks


def best_owned_ranks(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    owners: torch.Tensor,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """For each query, how many candidates it does not own score at least as high as its best owned one.

    Image->text retrieval with several captions per image: image ``q`` owns every caption ``j`` with
    ``owners[j] == q``, and is found within the top k when any of them is (rank < k). Ties with another owned
    candidate do not count; ties with a candidate it does not own count against it.

    Args:
        queries: ``[Q, D]``.
        candidates: ``[N, D]``.
        owners: int64 ``[N]``, the query each candidate belongs to; every query must own at least one.
        chunk_elements: Largest number of scores held at once.

    Returns:
        int64 ``[Q]``: 0 when an owned candidate is strictly ahead of every other.
    """
    num_queries = queries.shape[0]
    owned_counts = torch.bincount(owners, minlength=num_queries)
    if owners.shape[0] != candidates.shape[0] or len(owned_counts) != num_queries or (owned_counts == 0).any():
        raise ValueError("owners must give each of the N candidates one of the Q queries, each query at least one")
    queries, candidates = queries.float(), candidates.float()
    ranks = torch.empty(num_queries, dtype=torch.long)
    rows, _ = _block_shape(num_queries, candidates.shape[0], chunk_elements)
    for start in range(0, num_queries, rows):
        block = queries[start : start + rows] @ candidates.t()
        owned = owners.unsqueeze(0) == torch.arange(start, start + block.shape[0]).unsqueeze(1)
        best = block.masked_fill(~owned, float("-inf")).amax(dim=1, keepdim=True)
        ranks[start : start + rows] = ((block >= best) & ~owned).sum(dim=1)
    return ranks
