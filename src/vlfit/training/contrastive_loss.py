"""BridgeTower's contrastive loss, with negatives from this process's batch or from the whole global batch.

BridgeTower's loss (``BridgeTowerForContrastiveLearning.forward``) averages three one-directional cross-entropy
terms over L2-normalized embeddings: text -> image, text -> cross-modal and image -> cross-modal, each with logits
scaled by ``logit_scale.exp()`` and the matching pair as the target.

With ``gather=True`` in a multi-process run, the columns (image and cross-modal embeddings, the only ones that
serve as candidates) are all-gathered from every process with gradient, so each of this process's rows is scored
against the whole global batch. Each process computes the loss of its own rows only (open_clip's
``local_loss=True``); the all-gather's backward sums the gradients that other processes' rows send to this
process's embeddings, and DDP's gradient averaging then yields exactly the gradient of the single-process loss on
the concatenated batch. No factor of world size is needed, and the text embeddings never need gathering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerContrastiveOutput

_HOOK_ATTRIBUTE = "_vlfit_logit_scale_hook"


def _distributed_world(group: Any = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


class _AllGatherRows(torch.autograd.Function):
    """All-gather equal-shaped tensors into ``[world, ...]``; backward sums every process's gradient for this one.

    (``torch.distributed.nn.functional.all_gather`` does the same, deprecated in recent torch; this needs only
    ``all_gather`` and ``all_reduce``, which every backend has.)
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group=group)
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every process's rows scored this process's columns: their gradients add up.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def gather_with_grad(tensor: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, int, int]:
    """All-gather ``tensor`` along dim 0 from every process of ``group``, keeping the autograd graph.

    Processes may hold different numbers of rows (a short last batch): sizes are exchanged first and every
    tensor is padded to the largest before the gather, then the padding is cut out again.

    Args:
        tensor: ``[n, ...]`` rows of this process.
        group: Process group (default: the world).

    Returns:
        The ``[N, ...]`` concatenation in rank order, the index of this process's first row in it, and N.
    """
    world = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    size = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes_list = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes_list, size, group=group)
    # Mismatched shapes in an all-gather hang NCCL, so the sizes are read on the host (one small sync per step).
    sizes = [int(s.item()) for s in sizes_list]
    largest = max(sizes)
    if tensor.shape[0] < largest:
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, largest - tensor.shape[0]))
    parts = _AllGatherRows.apply(tensor, group)
    gathered = torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])
    return gathered, sum(sizes[:rank]), sum(sizes)


def contrastive_loss(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    cross_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    *,
    gather: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """BridgeTower's contrastive loss, in float32 whatever the autocast state.

    Args:
        text_embeds: ``[n, d]`` L2-normalized text embeddings of this process's batch.
        image_embeds: ``[n, d]`` L2-normalized image embeddings, pair ``i`` with text ``i``.
        cross_embeds: ``[n, d]`` L2-normalized cross-modal embeddings.
        logit_scale: The multiplier of the cosine similarities, i.e. ``model.logit_scale.exp()`` (a scalar).
        gather: Score against the embeddings of every process of ``group`` (global negatives). Without an
            initialized process group, or with one process, this is the local loss.
        group: Process group to gather over (default: the world).

    Returns:
        A scalar. Local: the mean over this process's rows. Global: this process's rows' share of the global
        mean, ``sum(row losses) * world_size / global_batch``, so that averaging over processes (as DDP does with
        gradients and the Trainer with logged losses) gives the loss of the concatenated batch even when
        processes hold different numbers of rows.
    """
    device_type = text_embeds.device.type
    # Logits and softmax in float32: under bf16 autocast these [n, N] products would keep ~3 significant digits.
    with torch.autocast(device_type=device_type, enabled=False):
        text, image, cross = text_embeds.float(), image_embeds.float(), cross_embeds.float()
        scale = logit_scale.float()
        world = _distributed_world(group) if gather else 1
        if world > 1:
            all_image, offset, total = gather_with_grad(image, group)
            all_cross, _, _ = gather_with_grad(cross, group)
        else:
            all_image, all_cross, offset, total = image, cross, 0, text.shape[0]
        labels = torch.arange(offset, offset + text.shape[0], device=text.device)
        terms = (
            F.cross_entropy(text @ all_image.t() * scale, labels, reduction="sum"),
            F.cross_entropy(text @ all_cross.t() * scale, labels, reduction="sum"),
            F.cross_entropy(image @ all_cross.t() * scale, labels, reduction="sum"),
        )
        return (terms[0] + terms[1] + terms[2]) / 3.0 * (world / total)


@dataclass
class ContrastiveOutputWithScale(BridgeTowerContrastiveOutput):
    """``BridgeTowerContrastiveOutput`` plus ``logit_scale`` (the multiplier, ``exp`` of the parameter).

    A declared field rather than an added key: DDP and accelerate rebuild outputs from their fields.
    """

    logit_scale: torch.Tensor | None = None


def _add_logit_scale(module: nn.Module, args: tuple, output: Any) -> ContrastiveOutputWithScale:
    return ContrastiveOutputWithScale(**output, logit_scale=module.logit_scale.exp())


def expose_logit_scale(model: nn.Module) -> None:
    """Make ``model``'s forward return a ``ContrastiveOutputWithScale`` (with ``logit_scale.exp()``).

    The loss computed outside the model needs the scale from inside the forward: DDP (with
    ``find_unused_parameters``) treats a parameter that no forward output depends on as unused and fails when its
    gradient arrives later, and FSDP only holds the unsharded parameter during the forward. Idempotent.

    Args:
        model: A ``BridgeTowerForContrastiveLearning`` (unwrapped from DDP/FSDP).
    """
    if getattr(model, _HOOK_ATTRIBUTE, None) is None:
        setattr(model, _HOOK_ATTRIBUTE, model.register_forward_hook(_add_logit_scale))
