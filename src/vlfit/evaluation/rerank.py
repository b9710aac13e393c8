"""Re-ranking in evaluation (``--rerank_top_k K``): each query's top K candidates by cosine are scored again by the
model's image-text matching head (``vlfit.models.itm``), both directions, over the same pools and with the same
multi-caption protocol as the cosine recall (``vlfit.inference.recall``), which it is reported beside: ordered by
the head's log-odds alone (``*_rerank_recall@k``) and, with a weight (``--rerank_weight``, the run's saved one, or
swept here), by the log-odds plus the weight times the cosine (``*_fused_recall@k``, ``vlfit.inference.rerank_score``).
The pairs of the largest K are scored once; every smaller K, and every weight a sweep tries, re-orders those scores.
Beside the K asked for, K 4, 8 and 16 are reported (``TABLE_TOP_KS``, those the pools reach) with the head's time
per query, and logged as one table (``rerank_table``).

A re-ranked list is the top K in the order of their scores, then the other candidates in cosine order: re-ranking
moves candidates only within the top K. Ranks count ties against the right answer, as the cosine ranks do. The
fused tower needs the captions' tokens and the images' pixels, not their embeddings: evaluation keeps them
(``PairInputs``) when re-ranking is asked for, pixels included (images x 3 x side x side in the model's dtype).
Matching accuracy by the head (``matching_accuracy_itm``) is scored as the split is embedded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vlfit.errors import ConfigError
from vlfit.inference.recall import RECALL_KS
from vlfit.inference.rerank_score import FUSED, ITM_ONLY, SWEPT_WEIGHTS, RerankScore
from vlfit.models.itm import has_itm_head, pair_scores

# Pairs per fused pass when re-ranking.
PAIRS_PER_PASS = 256
# The Ks of the table evaluation reports beside the one asked for: what re-ranking more candidates buys, and costs.
TABLE_TOP_KS = (4, 8, 16)

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


@dataclass
class Candidates:
    """Each query's best ``K`` candidates by cosine (one direction of one pool, or several concatenated), what every
    re-ranked rank is counted from: re-ranking only moves candidates within them.

    Attributes:
        cosine: ``[Q, K]`` their cosines, best first.
        matching: ``[Q, K]`` the matching head's log-odds of each (query, candidate) pair.
        is_target: ``[Q, K]`` whether the candidate is a right answer.
        cosine_rank: ``[Q]`` the rank of the query's best right answer in cosine order (ties counted against it).
    """

    cosine: torch.Tensor
    matching: torch.Tensor
    is_target: torch.Tensor
    cosine_rank: torch.Tensor

    @classmethod
    def of(cls, scores: torch.Tensor, target: torch.Tensor, top_k: int, rescore: PairScorer) -> Candidates:
        """The top ``top_k`` of each row of ``scores`` ``[Q, N]`` (``target`` ``[Q, N]`` bool, at least one per
        row), their pairs scored by ``rescore`` (query indices, candidate indices -> log-odds ``[P]``)."""
        cosine, top = scores.topk(min(top_k, scores.shape[1]), dim=1)  # sorted: the first k are the top k
        queries = torch.arange(scores.shape[0]).unsqueeze(1).expand_as(top)
        matching = rescore(queries.reshape(-1), top.reshape(-1)).view_as(top).to(scores.dtype)
        best = scores.masked_fill(~target, float("-inf")).amax(dim=1, keepdim=True)
        cosine_rank = ((scores >= best) & ~target).sum(dim=1)
        return cls(cosine, matching, target.gather(1, top), cosine_rank)

    @classmethod
    def cat(cls, parts: list[Candidates]) -> Candidates:
        """The candidates of several pools' queries, in order; a smaller pool's (fewer than K images) padded with
        candidates that never rank above anything (log-odds -inf, not a right answer)."""
        width = max(part.cosine.shape[1] for part in parts)

        def padded(tensor: torch.Tensor, value: float | bool) -> torch.Tensor:
            return F.pad(tensor, (0, width - tensor.shape[1]), value=value) if tensor.shape[1] < width else tensor

        return cls(torch.cat([padded(part.cosine, 0.0) for part in parts]),
                   torch.cat([padded(part.matching, float("-inf")) for part in parts]),
                   torch.cat([padded(part.is_target, False) for part in parts]),
                   torch.cat([part.cosine_rank for part in parts]))  # fmt: skip

    def ranks(self, top_k: int, score: RerankScore = ITM_ONLY) -> torch.Tensor:
        """The rank ``[Q]`` of each query's best right answer once its top ``top_k`` are re-ordered by ``score``
        (the log-odds, or the log-odds plus the weight times the cosine), ties counted against it; a query with no
        right answer among them keeps its cosine rank (everything above it is in the top K, unmoved)."""
        cosine, matching, target = self.cosine[:, :top_k], self.matching[:, :top_k], self.is_target[:, :top_k]
        value = matching + score.weight * cosine if score.fused else matching
        best = value.masked_fill(~target, float("-inf")).amax(dim=1, keepdim=True)
        above = ((value >= best) & ~target).sum(dim=1)
        return torch.where(target.any(dim=1), above, self.cosine_rank)


@dataclass
class RerankedRecall:
    """Both directions' candidates of a split and what scoring their pairs cost.

    Attributes:
        t2i, i2t: Text-to-image and image-to-text ``Candidates``.
        seconds_per_pair: The matching head's time per (query, candidate) pair, both directions together.
    """

    t2i: Candidates
    i2t: Candidates
    seconds_per_pair: float

    @property
    def top_k(self) -> int:
        """The most candidates per query scored."""
        return int(self.t2i.cosine.shape[1])

    def recall(self, top_k: int, score: RerankScore = ITM_ONLY, ks: tuple[int, ...] = RECALL_KS) -> dict[str, float]:
        """``{"t2i@k", "i2t@k"}`` recall after re-ranking each query's top ``top_k`` by ``score``."""
        ranks = {"t2i": self.t2i.ranks(top_k, score), "i2t": self.i2t.ranks(top_k, score)}
        return {f"{way}@{k}": (rank < k).float().mean().item() for way, rank in ranks.items() for k in ks}

    def milliseconds_per_query(self, top_k: int) -> float:
        """The matching head's time to re-rank one query's ``top_k`` candidates (its time per pair, times K)."""
        return 1000.0 * self.seconds_per_pair * top_k

    def sweep(self, top_k: int, weights: tuple[float, ...] = SWEPT_WEIGHTS) -> tuple[float, dict[str, float]]:
        """The weight of ``itm+itc`` with the best mean of t2i and i2t recall@1 at ``top_k`` (ties: the better
        mean recall@5, then the first tried), and that mean for each weight tried."""
        tried: dict[float, tuple[float, float]] = {}
        for weight in weights:
            recall = self.recall(top_k, RerankScore(FUSED, weight), ks=(1, 5))
            tried[weight] = ((recall["t2i@1"] + recall["i2t@1"]) / 2, (recall["t2i@5"] + recall["i2t@5"]) / 2)
        best = max(weights, key=lambda weight: tried[weight])  # max keeps the first of equals
        return best, {f"{weight:g}": round(tried[weight][0], 6) for weight in weights}


def rerank_candidates(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    image_of_text: torch.Tensor,
    pool_size: int | None,
    top_k: int,
    score_pairs: PairScorer,
) -> RerankedRecall:
    """Each query's best ``top_k`` candidates by cosine, both ways, over ``pooled_recall_at_k``'s pools, their pairs
    scored by the matching head (timed).

    Args:
        text_embeds: ``[texts, D]``; image_embeds: ``[images, D]`` the unique images; image_of_text: ``[texts]``.
        pool_size: Images per pool (``None`` or < 1: all).
        top_k: Candidates scored per query (the largest K re-ranked).
        score_pairs: Matching scores ``[P]`` of (text ``t[i]``, image ``i[i]``) pairs, indices into the split.

    Raises:
        ConfigError: ``top_k`` is larger than the pool.
    """
    num_images = image_embeds.shape[0]
    pool_size = num_images if pool_size is None or pool_size <= 0 else min(pool_size, num_images)
    if top_k > pool_size:
        raise ConfigError(
            f"--rerank_top_k {top_k} is larger than the pool of {pool_size} images each query ranks "
            "(--eval_pool_size, or the split); lower it"
        )
    pairs, seconds = 0, 0.0

    def timed(texts: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        nonlocal pairs, seconds
        started = time.perf_counter()
        scores = score_pairs(texts, images)
        seconds += time.perf_counter() - started
        pairs += len(texts)
        return scores

    t2i, i2t = [], []
    for start in range(0, num_images, pool_size):
        stop = min(start + pool_size, num_images)
        texts = ((image_of_text >= start) & (image_of_text < stop)).nonzero().squeeze(1)
        images = torch.arange(start, stop)
        owner = image_of_text[texts].unsqueeze(1) == images.unsqueeze(0)  # [texts, images]
        similarity = text_embeds[texts].float() @ image_embeds[start:stop].float().t()
        t2i.append(_candidates(similarity, owner, top_k, lambda q, c, t=texts, i=images: timed(t[q], i[c])))
        i2t.append(_candidates(similarity.t(), owner.t(), top_k, lambda q, c, t=texts, i=images: timed(t[c], i[q])))
    return RerankedRecall(Candidates.cat(t2i), Candidates.cat(i2t), seconds / max(pairs, 1))


def _candidates(scores: torch.Tensor, target: torch.Tensor, top_k: int, rescore: PairScorer) -> Candidates:
    """``Candidates.of`` every query, ``PAIRS_PER_PASS`` pairs of queries at a time."""
    step = max(1, PAIRS_PER_PASS // top_k)
    parts = []
    for first in range(0, scores.shape[0], step):
        rows = slice(first, first + step)
        parts.append(Candidates.of(scores[rows], target[rows], top_k, lambda q, c, o=first: rescore(q + o, c)))
    return Candidates.cat(parts)


def reranked_recall(
    candidates: RerankedRecall,
    top_k: int,
    weight: float | None = None,
    *,
    top_ks: tuple[int, ...] = TABLE_TOP_KS,
) -> dict[str, float]:
    """Recall both ways re-ranked by the matching head alone and, given a ``weight``, fused with the cosine.

    Returns:
        At ``top_k``: ``t2i_rerank_recall@k`` and ``i2t_rerank_recall@k`` (ITM alone), ``t2i_fused_recall@k`` and
        ``i2t_fused_recall@k`` (``itm+itc``, with a weight), ``rerank_top_k``, ``rerank_weight`` and
        ``rerank_ms_per_query``; for each of ``top_ks`` that the candidates reach, recall@1 and @5 of both as
        ``t2i_rerank_top{K}_recall@k`` and ``t2i_fused_top{K}_recall@k`` and ``rerank_top{K}_ms_per_query``.
    """
    scores = {"rerank": ITM_ONLY}
    if weight is not None:
        scores["fused"] = RerankScore(FUSED, weight)
    metrics: dict[str, float] = {}
    for name, score in scores.items():
        for key, value in candidates.recall(top_k, score).items():
            way, k = key.split("@")
            metrics[f"{way}_{name}_recall@{k}"] = value
    metrics["rerank_top_k"] = float(top_k)
    if weight is not None:
        metrics["rerank_weight"] = float(weight)
    metrics["rerank_ms_per_query"] = candidates.milliseconds_per_query(top_k)
    for table_k in sorted(k for k in {*top_ks, top_k} if k <= candidates.top_k):
        for name, score in scores.items():
            for key, value in candidates.recall(table_k, score, ks=(1, 5)).items():
                way, k = key.split("@")
                metrics[f"{way}_{name}_top{table_k}_recall@{k}"] = value
        metrics[f"rerank_top{table_k}_ms_per_query"] = candidates.milliseconds_per_query(table_k)
    return metrics


def rerank_table(metrics: dict[str, float]) -> list[str]:
    """Cosine, ITM-only and fused recall@1/@5 both ways side by side, one row per K re-ranked, with the matching
    head's time per query: the lines evaluation logs."""
    lines = [f"{'ranking':<22} {'t2i R@1':>8} {'t2i R@5':>8} {'i2t R@1':>8} {'i2t R@5':>8} {'ms/query':>9}"]

    def row(name: str, prefix: str, ms: float | None) -> str:
        cells = [metrics.get(f"{way}_{prefix}recall@{k}", float("nan")) for way in ("t2i", "i2t") for k in (1, 5)]
        shown = f"{ms:>9.2f}" if ms is not None else f"{'':>9}"
        return f"{name:<22} " + " ".join(f"{cell:>8.3f}" for cell in cells) + f" {shown}"

    lines.append(row("cosine", "", None))
    for top_k in sorted({*(int(k[len("rerank_top") : -len("_ms_per_query")]) for k in metrics
                           if k.startswith("rerank_top") and k.endswith("_ms_per_query"))}):  # fmt: skip
        ms = metrics[f"rerank_top{top_k}_ms_per_query"]
        lines.append(row(f"itm, top {top_k}", f"rerank_top{top_k}_", ms))
        if "rerank_weight" in metrics:
            lines.append(row(f"itm+itc {metrics['rerank_weight']:g}, top {top_k}", f"fused_top{top_k}_", ms))
    return lines


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
