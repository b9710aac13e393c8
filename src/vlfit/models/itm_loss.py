"""The image-text matching (ITM) loss: BridgeTower's matching head on the batch's pairs and on hard negatives mined
from the in-batch contrastive similarities, as ALBEF, BLIP and METER train it.

For each caption one negative image, and for each image one negative caption, is drawn with probability
proportional to the softmax of the (scaled) contrastive similarities, never the pair's own and never a row showing
the same image (``image_keys``: the other captions of the pair's image are not negatives). The fused tower scores
the positives (the forward's own ``itm_logits``) and the 2 x B negatives from the unimodal states the forward already
computed; the loss is the 2-way cross-entropy of the head (match / no match) over the 3 x B pairs. With
``--hard_negative_column`` each image is also paired with one of its own alternative captions (drawn uniformly; the
caption through the text tower, then the fused tower): the negatives the data names, as hard as a caption that
differs by one attribute, one more pair per row.

With global negatives the candidates are every process's rows: similarities against all-gathered embeddings, and
the unimodal states of the drawn negatives all-gathered with gradient (BLIP's ``all_gather_with_grad``). The draw is
Gumbel-max over a noise matrix of the whole global batch seeded the same on every process, so one process and two
draw the same negatives and compute the same loss and gradient (a test checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vlfit.models.bridgetower import contrastive_embeddings, expose_logit_scale
from vlfit.models.family import HARD_NEGATIVE_ATTENTION_MASK, HARD_NEGATIVE_INPUT_IDS, IMAGE_KEYS, LOCAL_LOSS, LossScope
from vlfit.models.itm import UnimodalStates, fused_pooled_output, states_from_outputs, text_states
from vlfit.models.losses import distributed_world, gather_rows, gather_with_grad
from vlfit.models.unwrap import held_model


@dataclass
class MatchingLoss:
    """The ITM loss of one batch and what is logged of it.

    Attributes:
        loss: This process's share of the loss (averaged over processes it is the global batch's mean).
        accuracy: The head's accuracy on this process's pairs (detached).
        pairs: Pairs scored here (positives and negatives).
    """

    loss: torch.Tensor
    accuracy: torch.Tensor
    pairs: int


def sample_negatives(
    similarity: torch.Tensor, excluded: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One negative per row, drawn in proportion to ``softmax(similarity)`` over the allowed candidates.

    Gumbel-max: ``argmax(similarity + g)`` with ``g = -log(-log(u))`` draws from the softmax. No gradient flows.

    Args:
        similarity: ``[n, N]`` scaled similarities of this process's queries with every candidate.
        excluded: ``[n, N]`` True where a candidate may not be drawn (the query's own pair, its image's rows).
        noise: ``[n, N]`` uniform draws in (0, 1).

    Returns:
        The candidate drawn for each row ``[n]`` and whether the row had any allowed candidate ``[n]``.
    """
    with torch.no_grad():
        gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1 - 1e-7)))
        keyed = (similarity.float() + gumbel).masked_fill(excluded, float("-inf"))
        return keyed.argmax(dim=1), ~excluded.all(dim=1)


def excluded_candidates(image_keys: torch.Tensor | None, rows: int, all_keys: torch.Tensor | None, offset: int,
                        total: int, device: torch.device) -> torch.Tensor:  # fmt: skip
    """``[rows, total]`` True for each row's own pair and, with image keys, every row showing its image."""
    if image_keys is not None and all_keys is not None:
        excluded = image_keys.unsqueeze(1) == all_keys.unsqueeze(0)
    else:
        excluded = torch.zeros(rows, total, dtype=torch.bool, device=device)
    own = torch.arange(rows, device=device)
    excluded[own, own + offset] = True
    return excluded


def noise_rows(seed: int, total: int, offset: int, rows: int, device: torch.device, block: int = 256) -> torch.Tensor:
    """Rows ``[offset, offset + rows)`` of the draw's ``[2, total, total]`` uniform noise, the same on every process
    whatever its rows: drawn ``block`` rows at a time from one seeded generator, so memory stays at ``2 x block x
    total`` however large the global batch."""
    generator = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for start in range(0, offset + rows, block):
        chunk = torch.rand(2, min(block, total - start), total, generator=generator, device=device)
        low, high = max(offset - start, 0), min(offset + rows - start, chunk.shape[1])
        if low < high:
            parts.append(chunk[:, low:high])
    return torch.cat(parts, dim=1)


def draw_alternatives(valid: torch.Tensor, seed: int, offset: int, total: int) -> torch.Tensor:
    """For each row of ``valid`` (``[B, K]``: which of its K slots hold an alternative caption), one valid slot drawn
    uniformly (0 for a row without any), from one uniform number per row of the global batch: rows ``offset`` to
    ``offset + B`` of ``total`` draw the same slots whichever process holds them."""
    count = valid.sum(dim=1)
    generator = torch.Generator(device=valid.device).manual_seed(seed ^ 0x5EED)
    uniform = torch.rand(total, generator=generator, device=valid.device)[offset : offset + len(valid)]
    wanted = (uniform * count).long().clamp(max=count.clamp(min=1) - 1)  # the wanted-th valid slot of its row
    return (valid.cumsum(dim=1) <= wanted.unsqueeze(1)).sum(dim=1)


def alternative_caption_logits(model: Any, states: UnimodalStates, inputs: Mapping[str, torch.Tensor], seed: int,
                               offset: int, total: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The matching head's logits of each image with one of its row's own alternative captions
    (``--hard_negative_column``: captions that differ from the image's by an attribute), drawn uniformly among the
    row's alternatives; rows without any add no pair.

    The draw depends on the seed and the row's place in the global batch (``offset`` of ``total`` rows), not on
    how many alternatives other rows have, so one process and two draw the same captions.

    Returns:
        The logits ``[n, 2]``, and when no row has an alternative a zero to add to the loss: the passes then ran on
        the first row's own caption and image, weighed by nothing, so every process calls the same layers (FSDP
        gathers their weights inside the calls).
    """
    ids, mask = inputs[HARD_NEGATIVE_INPUT_IDS], inputs[HARD_NEGATIVE_ATTENTION_MASK]  # [B, K, L]
    valid = mask.bool().any(dim=-1)
    slot = draw_alternatives(valid, seed, offset, total)
    rows = valid.any(dim=1).nonzero().squeeze(1)
    if not len(rows):
        caption_ids, caption_mask, images = inputs["input_ids"][:1], inputs["attention_mask"][:1], states.image[:1]
    else:
        caption_ids, caption_mask, images = ids[rows, slot[rows]], mask[rows, slot[rows]], states.image[rows]
    pairs = UnimodalStates(text_states(model, caption_ids, caption_mask), caption_mask, images)
    logits = model.itm_score(fused_pooled_output(model, pairs))
    return (logits[:0], logits.sum() * 0) if not len(rows) else (logits, None)


def _gather_states(states: UnimodalStates, world: int) -> tuple[UnimodalStates, int, int]:
    """Every process's unimodal states (with gradient), captions padded to the longest of any process."""
    if world == 1:
        return states, 0, states.text.shape[0]
    length = torch.tensor([states.text.shape[2]], device=states.text.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    pad = int(length) - states.text.shape[2]
    text = F.pad(states.text, (0, 0, 0, pad)) if pad else states.text
    mask = F.pad(states.text_mask, (0, pad)) if pad else states.text_mask
    all_text, offset, total = gather_with_grad(text)
    all_mask, _, _ = gather_rows(mask)
    all_image, _, _ = gather_with_grad(states.image)
    return UnimodalStates(all_text, all_mask, all_image), offset, total


def matching_loss(
    model: Any,
    outputs: Any,
    inputs: Mapping[str, torch.Tensor],
    *,
    gather: bool = False,
    seed: int = 0,
) -> MatchingLoss:
    """The ITM loss of one batch from its contrastive forward.

    Args:
        model: The model as training calls it (possibly DDP-wrapped); it has a matching head.
        outputs: Its forward's output on ``inputs`` (``itm_logits``, the embeddings, ``hidden_states`` and the
            ``logit_scale`` of ``vlfit.models.bridgetower.expose_logit_scale``).
        inputs: The batch (``attention_mask``; ``image_keys`` when rows may share an image).
        gather: Draw negatives from every process's rows (``--contrastive_negatives global``).
        seed: Seeds the draw; every process must pass the same one.
    """
    unwrapped = held_model(model)
    world = distributed_world() if gather else 1
    rows = outputs.text_embeds.shape[0]
    device = outputs.text_embeds.device
    states = states_from_outputs(unwrapped, outputs, inputs["attention_mask"])
    with torch.no_grad():
        text_embeds, image_embeds = outputs.text_embeds.detach().float(), outputs.image_embeds.detach().float()
        keys = inputs.get(IMAGE_KEYS)
        if world > 1:
            all_texts, offset, total = gather_rows(text_embeds)
            all_images, _, _ = gather_rows(image_embeds)
            all_keys = gather_rows(keys)[0] if keys is not None else None
        else:
            all_texts, all_images, offset, total, all_keys = text_embeds, image_embeds, 0, rows, keys
        scale = outputs.logit_scale.detach().float().mean()
        excluded = excluded_candidates(keys, rows, all_keys, offset, total, device)
        noise = noise_rows(seed, total, offset, rows, device)
        negative_image, image_found = sample_negatives(text_embeds @ all_images.t() * scale, excluded, noise[0])
        negative_text, text_found = sample_negatives(image_embeds @ all_texts.t() * scale, excluded, noise[1])
    every, offset, total = _gather_states(states, world)
    own = torch.arange(rows, device=device)
    text_rows = torch.cat([own[image_found] + offset, negative_text[text_found]])
    image_rows = torch.cat([negative_image[image_found], own[text_found] + offset])
    # No row had a candidate (every row shows one image): the fused pass still runs, on the first own pair weighed
    # by nothing, so every process calls the same layers (FSDP gathers their weights inside the calls).
    placeholder = not len(text_rows)
    if placeholder:
        text_rows = image_rows = own[:1] + offset
    negatives = UnimodalStates(every.text[text_rows], every.text_mask[text_rows], every.image[image_rows])
    # Captions padded to another process's length: their extra positions are masked out.
    mined = unwrapped.itm_score(fused_pooled_output(unwrapped, negatives))
    unweighed = mined.sum() * 0 if placeholder else None
    negative_logits = [mined[:0] if placeholder else mined]
    if HARD_NEGATIVE_INPUT_IDS in inputs:
        alternatives, none = alternative_caption_logits(unwrapped, states, inputs, seed, offset, total)
        negative_logits.append(alternatives)
        unweighed = none if unweighed is None else unweighed + none
    logits = torch.cat([outputs.itm_logits, *negative_logits]).float()
    negative_count = sum(len(part) for part in negative_logits)
    labels = torch.cat([torch.ones(rows, dtype=torch.long, device=device),
                        torch.zeros(negative_count, dtype=torch.long, device=device)])  # fmt: skip
    pairs = torch.tensor([float(len(labels))], device=device)
    if world > 1:
        dist.all_reduce(pairs)
    loss = F.cross_entropy(logits, labels, reduction="sum") * (world / pairs[0])
    if unweighed is not None:
        loss = loss + unweighed
    accuracy = (logits.detach().argmax(dim=1) == labels).float().mean()
    return MatchingLoss(loss, accuracy, len(labels))


def contrastive_and_matching_loss(
    family: Any,
    model: Any,
    inputs: Mapping[str, torch.Tensor],
    *,
    contrastive: bool = True,
    scope: LossScope = LOCAL_LOSS,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """BridgeTower's training loss with the matching objective: one forward, its contrastive loss (as
    ``BridgeTowerFamily.contrastive_loss`` computes it; left out when ``contrastive`` is False) plus the ITM loss.

    Returns:
        The loss, and its terms to log (``loss_contrastive``, ``loss_itm``, ``itm_accuracy``; detached).
    """
    unwrapped = held_model(model)
    expose_logit_scale(unwrapped)
    outputs = model(**{key: inputs[key] for key in family.model_inputs}, return_loss=False)
    matching = matching_loss(model, outputs, inputs, gather=scope.global_negatives, seed=seed)
    terms = {"loss_itm": matching.loss.detach(), "itm_accuracy": matching.accuracy}
    loss = matching.loss
    if contrastive:
        embeddings = contrastive_embeddings(unwrapped, outputs, inputs)
        itc = family.loss_from_embeddings(embeddings, scope)
        terms["loss_contrastive"] = itc.detach()
        loss = itc + loss
    return loss, terms
