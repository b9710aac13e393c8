"""Embed a split and score it: text<->image recall@1/5/10 and New Yorker ``matching`` accuracy.

Rows that show the same image (equal ``image_keys``: several captions of one image) are one image: recall is
scored over the unique images and all captions (``vlfit.inference.recall``).

Three steps, one way: each process embeds the batches it reads (``embed_split``), the processes' parts are merged
into one split in dataset order with each sample once (``merge_splits``), and the merged split is scored
(``score_split``). Nothing is exchanged between processes per batch: the only collective is the one gather of the
parts at the end, so processes whose batches lost different numbers of bad samples, or that read different
numbers of batches, cannot fall out of step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vlfit.data.batch import BadSample, Batch
from vlfit.data.hard_negatives import right_choice
from vlfit.data.image_groups import group_images
from vlfit.data.records import CAPTION_CHOICE
from vlfit.errors import DataError
from vlfit.evaluation.rerank import (
    TABLE_TOP_KS,
    PairInputs,
    check_rerank,
    choice_scores,
    merge_pair_inputs,
    rerank_candidates,
    rerank_table,
    reranked_recall,
    split_pair_scorer,
)
from vlfit.inference.recall import matching_accuracy, pooled_recall_at_k
from vlfit.models.family import IMAGE_KEYS, ModelFamily, image_inputs, tokenize_captions
from vlfit.models.itm import has_itm_head
from vlfit.models.sharding import unsharded

logger = logging.getLogger(__name__)


@dataclass
class EmbeddedSplit:
    """Embeddings of (part of) an evaluation split, one row per valid sample, on the CPU.

    Attributes:
        positions: Each row's index in the split (``Batch.positions``): what merging orders and de-duplicates by.
        texts: Per batch, caption embeddings ``[b, d]``.
        images: Per batch, image embeddings ``[b, d]``.
        image_keys: Per batch, which image each row shows ``[b]`` (``Batch`` input ``image_keys``); ``None``
            once a batch had none (every row is then its own image).
        choices: Per batch, embeddings of the caption choices ``[b, c, d]``; ``None`` once a batch had none usable.
        labels: Per batch, the index of the right choice ``[b]``; ``None`` with ``choices``.
        bad_samples: Every sample left out.
        pair_inputs: The rows' tokens and pixels, kept for re-ranking (``vlfit.evaluation.rerank``), else None.
        choice_matches: Per batch, the matching head's scores of each image with its caption choices ``[b, c]``;
            ``None`` without a matching head or choices.
    """

    positions: list[int] = field(default_factory=list)
    texts: list[torch.Tensor] = field(default_factory=list)
    images: list[torch.Tensor] = field(default_factory=list)
    image_keys: list[torch.Tensor] | None = field(default_factory=list)
    choices: list[torch.Tensor] | None = field(default_factory=list)
    labels: list[torch.Tensor] | None = field(default_factory=list)
    bad_samples: list[BadSample] = field(default_factory=list)
    pair_inputs: PairInputs | None = None
    choice_matches: list[torch.Tensor] | None = None

    def by_image(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The caption embeddings ``[rows, d]``, the image embeddings ``[rows, d]``, the row where each distinct
        image first appears ``[images]`` and each row's image among those ``[rows]`` (``group_images``)."""
        text_embeds, image_embeds = torch.cat(self.texts), torch.cat(self.images)
        first_rows, image_of_text = group_images(torch.cat(self.image_keys) if self.image_keys else None,
                                                 text_embeds.shape[0])  # fmt: skip
        return text_embeds, image_embeds, first_rows, image_of_text


@torch.no_grad()
def embed_split(
    family: ModelFamily,
    model: Any,
    batches: Iterable[Batch],
    *,
    tokenizer: Any,
    max_seq_length: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    keep_pair_inputs: bool = False,
) -> EmbeddedSplit:
    """Embed every batch with the family's unimodal encoders.

    Batches are model-ready evaluation batches (the pipeline's device feed): rows with their dataset positions,
    the samples left out as bad in ``bad_samples``, and ``caption_choices`` with each row's ``CAPTION_CHOICE`` when the
    split has them (the choice its label names, or without a label the one equal to its caption). Batches left
    empty by bad samples add only their bad samples. A model with a matching head also scores the caption choices
    with it; ``keep_pair_inputs`` keeps the rows' tokens and pixels for re-ranking.
    """
    model = getattr(model, "module", model)
    part = EmbeddedSplit(pair_inputs=PairInputs() if keep_pair_inputs else None)
    part.choice_matches = [] if has_itm_head(model) else None
    with in_eval_mode(model), unsharded(model):  # FSDP2: the towers run outside the root forward that gathers shards
        for batch in batches:
            part.bad_samples.extend(batch.bad_samples)
            if not len(batch):
                continue
            part.positions.extend(int(position) for position in batch.positions)
            if part.pair_inputs is not None:
                part.pair_inputs.add(batch)
            if part.image_keys is not None and IMAGE_KEYS in batch:
                part.image_keys.append(batch[IMAGE_KEYS].cpu())
            else:
                part.image_keys = None
            with autocast():
                text_embeds = family.encode_text(model, batch["input_ids"], batch["attention_mask"])
                part.texts.append(text_embeds.float().cpu())
                part.images.append(family.encode_image(model, **image_inputs(batch.inputs)).float().cpu())
                if part.choices is None:
                    continue
                batch_choices, right = batch.columns.get("caption_choices"), _right_choices(batch)
                if not (batch_choices and all(index is not None for index in right)):
                    part.choices = part.labels = None
                    continue
                flat = [str(choice) for sample in batch_choices for choice in sample]
                tokens = tokenize_captions(tokenizer, flat, max_seq_length)
                input_ids, attention_mask = tokens["input_ids"].to(device), tokens["attention_mask"].to(device)
                embeds = family.encode_text(model, input_ids, attention_mask).float().cpu()
                part.choices.append(embeds.view(len(batch_choices), len(batch_choices[0]), -1))
                part.labels.append(torch.tensor(right))  # type: ignore[union-attr]
                if part.choice_matches is not None:
                    choice_tokens = {"input_ids": input_ids, "attention_mask": attention_mask}
                    part.choice_matches.append(choice_scores(model, batch, choice_tokens))
    return part


@contextlib.contextmanager
def in_eval_mode(model: Any) -> Iterator[None]:
    """``model`` in eval mode within, in the mode it was in after (training, when evaluated during training)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _right_choices(batch: Batch) -> list[int | None]:
    """Each row's right choice among its ``caption_choices`` (``right_choice``: its label's, else the one equal to
    its caption); None for a row with nothing to be matched against."""
    missing = [None] * len(batch)
    rows = zip(batch.columns.get("caption_choices") or missing, batch.columns.get("label") or missing,
               batch.columns.get(CAPTION_CHOICE) or missing, batch.sample_ids, strict=True)  # fmt: skip
    return [right_choice(choices, label, by_caption, sample_id=row) for choices, label, by_caption, row in rows]


def merge_splits(parts: list[EmbeddedSplit]) -> EmbeddedSplit:
    """One split from the processes' parts: rows in position order, each position once.

    A distributed sampler pads the last round of batches by repeating samples from the start of the split (so
    every process gets the same number of batches); those repeats, and the repeated bad-sample reports, are
    dropped here. Caption choices are kept only if every part that has samples has them.
    """
    positions = [position for part in parts for position in part.positions]
    merged = EmbeddedSplit(bad_samples=list(dict.fromkeys(bad for part in parts for bad in part.bad_samples)))
    if not positions:
        merged.choices = merged.labels = None
        return merged
    order = sorted(range(len(positions)), key=positions.__getitem__)  # stable: the first copy of a position wins
    keep = [row for i, row in enumerate(order) if i == 0 or positions[row] != positions[order[i - 1]]]
    rows = torch.tensor(keep, dtype=torch.long)
    with_samples = [part for part in parts if part.positions]  # parts without rows have no batches to concatenate

    def kept_rows(per_part: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.cat([batch for batches in per_part for batch in batches]).index_select(0, rows)]

    merged.positions = [positions[row] for row in keep]
    merged.texts = kept_rows([part.texts for part in with_samples])
    merged.images = kept_rows([part.images for part in with_samples])
    if all(part.image_keys is not None and len(part.image_keys) == len(part.texts) for part in with_samples):
        merged.image_keys = kept_rows([part.image_keys for part in with_samples])  # type: ignore[misc]
    else:
        merged.image_keys = None
    if all(part.choices is not None and part.labels is not None for part in with_samples):
        merged.choices = kept_rows([part.choices for part in with_samples])  # type: ignore[misc]
        merged.labels = kept_rows([part.labels for part in with_samples])  # type: ignore[misc]
    else:
        merged.choices = merged.labels = None
    if all(part.choice_matches for part in with_samples) and merged.choices is not None:
        merged.choice_matches = kept_rows([part.choice_matches for part in with_samples])  # type: ignore[misc]
    if all(part.pair_inputs is not None for part in with_samples):
        merged.pair_inputs = merge_pair_inputs([part.pair_inputs for part in with_samples], rows)  # type: ignore[misc]
    return merged


def score_split(split: EmbeddedSplit, pool_size: int | None = None) -> dict[str, float]:
    """Recall@k both ways over pools of ``pool_size`` images (``None``: the whole split), and matching accuracy.

    Returns:
        ``t2i_recall@k``, ``i2t_recall@k``, ``chance_recall@1``, ``pool_size``, ``num_samples``, ``num_texts``,
        ``num_images``, ``embedding_dim``, ``bad_samples`` and, when caption choices exist, ``matching_accuracy`` and
        ``chance_matching_accuracy``.
    """
    if not split.positions:
        raise DataError("the evaluation split has no samples; check --eval_split and --max_eval_samples")
    text_embeds, image_embeds, first_rows, image_of_text = split.by_image()
    metrics = pooled_recall_at_k(text_embeds, image_embeds[first_rows], pool_size, image_of_text=image_of_text)
    metrics["embedding_dim"] = int(text_embeds.shape[-1])  # the size scored (vlfit eval --embedding_dim cuts it)
    if split.choices:
        choice_embeds, label_index = torch.cat(split.choices), torch.cat(split.labels)  # type: ignore[arg-type]
        metrics["matching_accuracy"] = matching_accuracy(image_embeds, choice_embeds, label_index)
        metrics["chance_matching_accuracy"] = 1.0 / choice_embeds.shape[1]
        if split.choice_matches:  # the matching head's choice beside the cosine's
            hits = torch.cat(split.choice_matches).argmax(dim=1) == label_index
            metrics["matching_accuracy_itm"] = hits.float().mean().item()
    else:
        logger.info("matching accuracy skipped: the split has no caption_choices, or a row whose own caption is not "
                    "one of its choices (no label names it, and none or several equal it)")  # fmt: skip
    metrics["bad_samples"] = len(split.bad_samples)
    return metrics


def evaluate_retrieval(
    family: ModelFamily,
    model: Any,
    batches: Iterable[Batch],
    *,
    tokenizer: Any,
    max_seq_length: int,
    device: torch.device,
    pool_size: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    gather_parts: Callable[[EmbeddedSplit], list[EmbeddedSplit]] | None = None,
    rerank_top_k: int | None = None,
    rerank_weight: float | None = None,
    save_rerank_weight: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, float], list[BadSample]]:
    """Embed this process's batches, merge the processes' parts and score the split.

    Args:
        family: The model family (its unimodal encoders).
        model: The model (or a wrapper exposing it as ``.module``).
        batches: Model-ready evaluation batches (see ``embed_split``).
        tokenizer: Tokenizes caption choices.
        max_seq_length: Truncation for caption choices.
        device: Where the model runs.
        pool_size: Candidate pool for recall (``None``: the whole split).
        autocast: Mixed-precision context for the forward passes.
        gather_parts: In distributed runs, every process's part, in rank order (one collective; every process
            must call it). ``None``: this process read the whole split.
        rerank_top_k: Also re-rank each query's top K by the model's matching head (``vlfit.evaluation.rerank``).
        rerank_weight: Also re-rank by the head's log-odds plus this weight times the cosine (``itm+itc``).
        save_rerank_weight: Sweep the weight on this split instead (re-ranking the top ``rerank_top_k``, or 16),
            report the fused recall at the best one and hand ``rerank_sweep``'s record to this.

    Returns:
        The metrics (see ``score_split``), the same on every process, and the samples left out.
    """
    check_rerank(model, rerank_top_k, pool_size)
    reranks = rerank_top_k is not None or save_rerank_weight is not None
    part = embed_split(family, model, batches, tokenizer=tokenizer, max_seq_length=max_seq_length, device=device,
                       autocast=autocast, keep_pair_inputs=reranks)  # fmt: skip
    split = merge_splits(gather_parts(part) if gather_parts is not None else [part])
    metrics = score_split(split, pool_size)
    if reranks and split.pair_inputs is not None:
        metrics.update(rerank_split(model, split, pool_size, rerank_top_k, device=device, autocast=autocast,
                                    weight=rerank_weight, save_weight=save_rerank_weight))  # fmt: skip
        for line in rerank_table(metrics):  # cosine, ITM and fused side by side
            logger.info("%s", line)
    return metrics, split.bad_samples


def rerank_split(
    model: Any,
    split: EmbeddedSplit,
    pool_size: int | None,
    top_k: int | None,
    *,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    weight: float | None = None,
    save_weight: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, float]:
    """``score_split``'s recall@k with each query's top ``top_k`` (None: 16, or the pool) re-ranked by the matching
    head alone and, with a ``weight`` or ``save_weight``, fused with the cosine (same pools; ``reranked_recall``'s
    metrics). ``save_weight`` sweeps the weight here (``rerank_sweep``) and gets the sweep's record. The model is
    whole: ``--rerank_top_k`` with ``--fsdp`` is refused (``vlfit.arguments.flag_rules``)."""
    assert split.pair_inputs is not None
    text_embeds, image_embeds, first_rows, image_of_text = split.by_image()
    model = getattr(model, "module", model)
    images = len(first_rows)
    pool = images if pool_size is None or pool_size <= 0 else min(pool_size, images)
    top_k = top_k if top_k is not None else min(max(TABLE_TOP_KS), pool)
    scored = max([top_k, *(k for k in TABLE_TOP_KS if k <= pool)])  # every K of the table from one scoring (a top_k
    # above the pool is refused by rerank_candidates, naming it)
    with in_eval_mode(model):
        scorer = split_pair_scorer(model, split.pair_inputs, first_rows, device, autocast)
        candidates = rerank_candidates(text_embeds, image_embeds[first_rows], image_of_text, pool_size, scored, scorer)
    if save_weight is not None:
        weight, tried = candidates.sweep(top_k)
        save_weight(rerank_sweep(weight, tried, top_k, len(text_embeds)))
    return reranked_recall(candidates, top_k, weight)


def rerank_sweep(weight: float, tried: dict[str, float], top_k: int, queries: int) -> dict[str, Any]:
    """What ``rerank.json`` records of a sweep: the weight, the K it re-ranked and the score of each weight tried."""
    return {"rerank_weight": weight, "top_k": top_k, "texts": queries,
            "metric": "mean of t2i and i2t recall@1, itm+itc", "swept": tried}  # fmt: skip
