"""Contrastive losses families compose: InfoNCE over (query, candidate) embedding pairs, local or global negatives.

Each term is one-directional: query ``i`` is scored against every candidate with candidate ``i`` as the target.
A family lists its terms (BridgeTower: text->image, text->cross, image->cross; CLIP: text->image and
image->text) and ``info_nce`` averages them.

With global negatives in a multi-process run, the candidates are all-gathered from every process with gradient,
so each of this process's queries is scored against the whole global batch. Each process computes the loss of its
own queries only (open_clip's ``local_loss=True``); the gather's backward sums the gradients that other processes'
queries send to this process's candidates, and DDP's gradient averaging then yields exactly the gradient of the
single-process loss on the concatenated batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
import torch.nn.functional as F


def distributed_world(group: Any = None) -> int:
    """Processes in ``group`` (1 without an initialized process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def gather_with_grad(tensor: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, int, int]:
    """All-gather ``tensor`` along dim 0 from every process of ``group``, keeping the autograd graph.

    Processes may hold different numbers of rows (a short last batch): sizes are exchanged first and every
    tensor is padded to the largest before the gather, then the padding is cut out again. The gather is torch's
    functional collective with autograd (``torch.distributed.nn.functional.all_gather``, which does the same, is
    deprecated in favour of it): its backward reduce-scatters, so this process's rows receive the sum of every
    process's gradient for them.

    Args:
        tensor: ``[n, ...]`` rows of this process.
        group: Process group (default: the world).

    Returns:
        The ``[N, ...]`` concatenation in rank order, the index of this process's first row in it, and N.
    """
    group = dist.group.WORLD if group is None else group
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
    gathered = functional_collectives.all_gather_single_autograd(tensor.contiguous(), 0, group)
    gathered = functional_collectives.wait_tensor(gathered)
    parts = gathered.split(largest)
    rows = torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])
    return rows, sum(sizes[:rank]), sum(sizes)


def info_nce(
    terms: Sequence[tuple[torch.Tensor, torch.Tensor]],
    logit_scale: torch.Tensor,
    *,
    gather: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """The mean of one-directional InfoNCE terms, in float32 whatever the autocast state.

    Args:
        terms: ``(queries, candidates)`` pairs of ``[n, d]`` L2-normalized embeddings of this process's batch; row
            ``i`` of both belongs to pair ``i``. A candidate tensor used by several terms is gathered once.
        logit_scale: The multiplier of the cosine similarities (``exp`` of a model's logit-scale parameter).
        gather: Score against the candidates of every process of ``group`` (global negatives). Without an
            initialized process group, or with one process, this is the local loss.
        group: Process group to gather over (default: the world).

    Returns:
        A scalar. Local: the mean over this process's rows. Global: this process's rows' share of the global
        mean, ``sum(row losses) * world_size / global_batch``, so that averaging over processes (as DDP does with
        gradients and the Trainer with logged losses) gives the loss of the concatenated batch even when
        processes hold different numbers of rows.
    """
    first = terms[0][0]
    # Logits and softmax in float32: under bf16 autocast these [n, N] products would keep ~3 significant digits.
    with torch.autocast(device_type=first.device.type, enabled=False):
        scale = logit_scale.float()
        rows = first.shape[0]
        world = distributed_world(group) if gather else 1
        gathered: dict[int, tuple[torch.Tensor, int, int]] = {}
        total_loss = first.new_zeros((), dtype=torch.float32)
        total = rows
        for queries, candidates in terms:
            key = id(candidates)
            if key not in gathered:
                candidates_f = candidates.float()
                gathered[key] = gather_with_grad(candidates_f, group) if world > 1 else (candidates_f, 0, rows)
            all_candidates, offset, total = gathered[key]
            labels = torch.arange(offset, offset + rows, device=first.device)
            total_loss = total_loss + F.cross_entropy(
                queries.float() @ all_candidates.t() * scale, labels, reduction="sum"
            )
        return total_loss / len(terms) * (world / total)
