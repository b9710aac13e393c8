"""Re-ranking in evaluation (``--rerank_top_k K``): each query's top K candidates by cosine are scored again by the
model's image-text matching head (``vlfit.models.itm``), both directions, over the same pools and with the same
multi-caption protocol as the cosine recall (``vlfit.inference.recall``), which it is reported beside.

A re-ranked list is the top K in the order of their matching scores, then the other candidates in cosine order:
re-ranking moves candidates only within the top K. Ranks count ties against the right answer, as the cosine ranks
do. The fused tower needs the captions' tokens and the images' pixels, not their embeddings: evaluation keeps them
(``PairInputs``) when re-ranking is asked for, pixels included (images x 3 x side x side in the model's dtype).
Matching accuracy by the head (``matching_accuracy_itm``) is scored as the split is embedded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vlfit.errors import ConfigError
from vlfit.inference.recall import RECALL_KS
from vlfit.models.itm import has_itm_head, pair_scores

# Pairs per fused pass when re-ranking.
PAIRS_PER_PASS = 256

PairScorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_rerank(model: Any, top_k: int | None, pool_size: int | None = None) -> None:
    """Refuse ``--rerank_top_k`` below 1, above ``--eval_pool_size`` or for a model without a matching head, in one
    line each (before anything is embedded; a K above a smaller split is refused when the split is scored)."""
    if top_k is None:
        return
    if int(top_k) < 1:
        raise ConfigError(f"--rerank_top_k must be at least 1, got {top_k}")
    if pool_size is not None and 0 < pool_size < top_k:
        raise ConfigError(f"--rerank_top_k {top_k} is larger than --eval_pool_size {pool_size}: a query has "
                          f"{pool_size} candidates; lower it")  # fmt: skip
    if not has_itm_head(model):
        raise ConfigError(
            f"--rerank_top_k {top_k}: the model has no image-text matching head to re-rank with (a BridgeTower "
            "model trained with --objective contrastive+itm or itm, or from a checkpoint with an itm_score head, has "
            "one); drop --rerank_top_k"
        )


# ----------------------------------------------------------------------------------------------- the ranking


def reranked_keys(scores: torch.Tensor, top_k: int, rescore: PairScorer) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort keys of the re-ranked lists: candidates sort by ``(in_top, value)``, descending.

    Args:
        scores: ``[Q, N]`` cosine scores of each query's candidates.
        top_k: How many of each query's best candidates are re-scored.
        rescore: The matching scores ``[P]`` of (query ``q[i]``, candidate ``c[i]``) pairs.

    Returns:
        ``in_top`` ``[Q, N]`` bool, and ``value`` ``[Q, N]``: the matching score in the top K, the cosine elsewhere.
    """
    top = scores.topk(min(top_k, scores.shape[1]), dim=1).indices
    queries = torch.arange(scores.shape[0]).unsqueeze(1).expand_as(top)
    matched = rescore(queries.reshape(-1), top.reshape(-1)).view_as(top).to(scores.dtype)
    in_top = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    return in_top, scores.clone().scatter_(1, top, matched)


def ranks_of_targets(in_top: torch.Tensor, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The rank ``[Q]`` of each query's best target (``target`` ``[Q, N]`` bool, at least one per row) in its
    re-ranked list, ties counted against it: how many other candidates sort at or above it."""
    group = in_top.float()
    best_group = group.masked_fill(~target, -1).amax(dim=1, keepdim=True)
    best_value = value.masked_fill(~(target & (group == best_group)), float("-inf")).amax(dim=1, keepdim=True)
    above = (group > best_group) | ((group == best_group) & (value >= best_value))
    return (above & ~target).sum(dim=1)


def reranked_recall(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    image_of_text: torch.Tensor,
    pool_size: int | None,
    top_k: int,
    score_pairs: PairScorer,
    ks: tuple[int, ...] = RECALL_KS,
) -> dict[str, float]:
    """Recall@k both ways after re-ranking each query's top ``top_k``, over ``pooled_recall_at_k``'s pools.

    Args:
        text_embeds: ``[texts, D]``; image_embeds: ``[images, D]`` the unique images; image_of_text: ``[texts]``.
        pool_size: Images per pool (``None`` or < 1: all).
        top_k: Candidates re-scored per query.
        score_pairs: Matching scores ``[P]`` of (text ``t[i]``, image ``i[i]``) pairs, indices into the split.

    Raises:
        ConfigError: ``top_k`` is larger than the pool.

    Returns:
        ``t2i_rerank_recall@k``, ``i2t_rerank_recall@k`` and ``rerank_top_k``.
    """
    num_images = image_embeds.shape[0]
    pool_size = num_images if pool_size is None or pool_size <= 0 else min(pool_size, num_images)
    if top_k > pool_size:
        raise ConfigError(
            f"--rerank_top_k {top_k} is larger than the pool of {pool_size} images each query ranks "
            "(--eval_pool_size, or the split); lower it"
        )
    t2i_ranks, i2t_ranks = [], []
    for start in range(0, num_images, pool_size):
        stop = min(start + pool_size, num_images)
        texts = ((image_of_text >= start) & (image_of_text < stop)).nonzero().squeeze(1)
        images = torch.arange(start, stop)
        owner = image_of_text[texts].unsqueeze(1) == images.unsqueeze(0)  # [texts, images]
        similarity = text_embeds[texts].float() @ image_embeds[start:stop].float().t()
        t2i_ranks.append(_ranks(similarity, owner, top_k, lambda q, c, t=texts, i=images: score_pairs(t[q], i[c])))
        i2t_ranks.append(
            _ranks(similarity.t(), owner.t(), top_k, lambda q, c, t=texts, i=images: score_pairs(t[c], i[q]))
        )
    t2i, i2t = torch.cat(t2i_ranks), torch.cat(i2t_ranks)
    metrics = {f"t2i_rerank_recall@{k}": (t2i < k).float().mean().item() for k in ks}
    metrics.update({f"i2t_rerank_recall@{k}": (i2t < k).float().mean().item() for k in ks})
    metrics["rerank_top_k"] = float(top_k)
    return metrics


def _ranks(scores: torch.Tensor, target: torch.Tensor, top_k: int, rescore: PairScorer) -> torch.Tensor:
    """Re-ranked ranks of every query's target, ``PAIRS_PER_PASS`` pairs of queries at a time."""
    step = max(1, PAIRS_PER_PASS // top_k)
    ranks = []
    for first in range(0, scores.shape[0], step):
        rows = slice(first, first + step)
        in_top, value = reranked_keys(scores[rows], top_k, lambda q, c, o=first: rescore(q + o, c))
        ranks.append(ranks_of_targets(in_top, value, target[rows]))
    return torch.cat(ranks)


# --------------------------------------------------------------------------------------- the fused passes


@dataclass
class PairInputs:
    """What the fused tower reads of each row of an evaluation split, per batch, on the CPU.

    Attributes:
        input_ids, attention_mask: Per batch, the captions' tokens ``[b, T_b]``.
        pixel_values: Per batch, the normalized images ``[b, 3, S, S]``.
    """

    input_ids: list[torch.Tensor] = field(default_factory=list)
    attention_mask: list[torch.Tensor] = field(default_factory=list)
    pixel_values: list[torch.Tensor] = field(default_factory=list)

    def add(self, batch: Any) -> None:
        """Keep a batch's inputs."""
        self.input_ids.append(batch["input_ids"].cpu())
        self.attention_mask.append(batch["attention_mask"].cpu())
        self.pixel_values.append(batch["pixel_values"].cpu())


def merge_pair_inputs(parts: list[PairInputs], rows: torch.Tensor) -> PairInputs:
    """One ``PairInputs`` of the merged split: the parts' batches concatenated (captions padded to the longest),
    then ``rows`` of them (``vlfit.evaluation.retrieval.merge_splits``' order)."""
    length = max(ids.shape[1] for part in parts for ids in part.input_ids)

    def padded(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([F.pad(t, (0, length - t.shape[1])) for t in tensors]).index_select(0, rows)

    return PairInputs(
        [padded([ids for part in parts for ids in part.input_ids])],
        [padded([mask for part in parts for mask in part.attention_mask])],
        [torch.cat([px for part in parts for px in part.pixel_values]).index_select(0, rows)],
    )


def split_pair_scorer(
    model: Any,
    inputs: PairInputs,
    image_rows: torch.Tensor,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> PairScorer:
    """Matching scores of (text, image) pairs of a merged split: texts are its rows, images its unique images
    (``image_rows``: each image's row)."""
    input_ids, attention_mask = torch.cat(inputs.input_ids), torch.cat(inputs.attention_mask)
    pixel_values = torch.cat(inputs.pixel_values)

    @torch.no_grad()
    def score(texts: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        model_texts, text_index = torch.unique(texts, return_inverse=True)
        model_images, image_index = torch.unique(image_rows[images], return_inverse=True)
        tokens = (input_ids[model_texts].to(device), attention_mask[model_texts].to(device))
        with autocast():
            scores = pair_scores(model, tokens, pixel_values[model_images].to(device), text_index.to(device),
                                 image_index.to(device))  # fmt: skip
        return scores.float().cpu()

    return score


def choice_scores(model: Any, batch: Any, choices: dict[str, torch.Tensor]) -> torch.Tensor:
    """Matching scores ``[b, c]`` of each row's image with each of its ``c`` caption choices (tokenized, ``[b*c,
    T]``, row-major), for ``matching_accuracy_itm``."""
    rows = batch["pixel_values"].shape[0]
    per_row = choices["input_ids"].shape[0] // rows
    device = batch["pixel_values"].device
    texts = torch.arange(rows * per_row, device=device)
    images = torch.arange(rows, device=device).repeat_interleave(per_row)
    scores = pair_scores(model, (choices["input_ids"], choices["attention_mask"]), batch["pixel_values"], texts, images)
    return scores.view(rows, per_row).float().cpu()
