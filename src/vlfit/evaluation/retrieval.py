"""Embed a split and score it: text<->image recall@1/5/10 and New Yorker ``matching`` accuracy."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vlfit.data.device_stage import DeviceStage
from vlfit.evaluation.metrics import label_to_index, matching_accuracy, pooled_recall_at_k
from vlfit.models.encoders import encode_image, encode_text

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate_retrieval(
    model: Any,
    batches: Iterable[dict[str, Any]],
    *,
    stage: DeviceStage,
    device: torch.device,
    tokenizer: Any,
    max_seq_length: int,
    pool_size: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Embed every batch with the unimodal encoders and compute retrieval and matching metrics.

    Args:
        model: A ``BridgeTowerForContrastiveLearning`` (or a wrapper exposing it as ``.module``).
        batches: Collated batches (with ``caption_choices`` and ``label`` when the split has them).
        stage: The device stage (normalization; decode on device).
        device: Where the model runs.
        tokenizer: Tokenizes caption choices.
        max_seq_length: Truncation for caption choices.
        pool_size: Candidate pool for recall (``None``: the whole split).
        autocast: Mixed-precision context for the forward passes.
        gather: Concatenates a tensor across processes (``accelerator.gather_for_metrics``) in distributed runs.
            Called once per batch, as it must be: at the last batch it drops the samples the distributed sampler
            repeated to even out the processes' shares.

    Returns:
        ``t2i_recall@k``, ``i2t_recall@k``, ``chance_recall@1``, ``pool_size``, ``num_samples`` and, when caption
        choices exist, ``matching_accuracy`` and ``chance_matching_accuracy``.
    """
    model = getattr(model, "module", model)
    was_training = model.training
    model.eval()
    dtype = next(model.parameters()).dtype
    texts, images, choices, labels = [], [], [], []
    has_choices = True
    gather = gather or (lambda tensor: tensor)
    for batch in batches:
        batch = stage(batch, device, dtype, train=False)
        with autocast():
            text_embeds = encode_text(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))
            texts.append(gather(text_embeds.float()))
            images.append(gather(encode_image(model, batch["pixel_values"]).float()))
            batch_choices, batch_labels = batch.get("caption_choices"), batch.get("label")
            if has_choices and batch_choices and batch_labels and all(c for c in batch_choices):
                num_choices = len(batch_choices[0])
                flat = [str(c) for sample in batch_choices for c in sample]
                tokens = tokenizer(
                    flat, max_length=max_seq_length, truncation=True, padding="longest", return_tensors="pt"
                ).to(device)
                embeds = encode_text(model, tokens["input_ids"], tokens["attention_mask"]).float()
                choices.append(gather(embeds.view(len(batch_choices), num_choices, -1)))
                labels.append(gather(torch.tensor([label_to_index(x) for x in batch_labels], device=device)))
            else:
                has_choices = False
    if was_training:
        model.train()
    if not texts:
        raise ValueError("the evaluation split has no samples; check --eval_split and --max_eval_samples")
    text_embeds, image_embeds = torch.cat(texts), torch.cat(images)
    metrics = pooled_recall_at_k(text_embeds.cpu(), image_embeds.cpu(), pool_size)
    if has_choices and choices:
        choice_embeds, label_index = torch.cat(choices), torch.cat(labels)
        metrics["matching_accuracy"] = matching_accuracy(image_embeds.cpu(), choice_embeds.cpu(), label_index.cpu())
        metrics["chance_matching_accuracy"] = 1.0 / choice_embeds.shape[1]
    else:
        logger.info("split has no usable caption_choices/label columns: matching accuracy skipped")
    return metrics
