"""Contrastive losses families compose: InfoNCE over (query, candidate) embedding pairs, local or global negatives.

Each term is one-directional: query ``i`` is scored against every candidate with candidate ``i`` as the target.
A family lists its terms (BridgeTower: text->image, text->cross, image->cross; CLIP: text->image and
image->text) and ``info_nce`` averages them.

With global negatives in a multi-process run, the candidates are all-gathered from every process with gradient,
so each of this process's queries is scored against the whole global batch. Each process computes the loss of its
own queries only (open_clip's ``local_loss=True``); the gather's backward sums the gradients that other processes'
queries send to this process's candidates, and DDP's gradient averaging then yields exactly the gradient of the
single-process loss on the concatenated batch.

Rows showing the same image (``image_keys``: several captions of one image, or repeated bytes) are not negatives
of each other: their scores are left out of every term, across processes too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
import torch.nn.functional as F

from vlfit.models.family import HARD_NEGATIVE_ATTENTION_MASK, HARD_NEGATIVE_INPUT_IDS, IMAGE_KEYS


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
    return _gather(tensor, group, autograd=True)


def gather_rows(tensor: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, int, int]:
    """``gather_with_grad`` for tensors without gradient (image keys): the same rows, offset and total."""
    return _gather(tensor, group, autograd=False)


def _gather(tensor: torch.Tensor, group: Any, *, autograd: bool) -> tuple[torch.Tensor, int, int]:
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
    if autograd:
        gathered = functional_collectives.all_gather_single_autograd(tensor.contiguous(), 0, group)
        gathered = functional_collectives.wait_tensor(gathered)
    else:
        gathered = tensor.new_empty((world * largest, *tensor.shape[1:]))
        dist.all_gather_into_tensor(gathered, tensor.contiguous(), group=group)
    parts = gathered.split(largest)
    rows = torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])
    return rows, sum(sizes[:rank]), sum(sizes)


class HardNegatives(NamedTuple):
    """Per-query extra candidates of one term: query ``i`` is also scored against ``embeds[i, :]``.

    Attributes:
        embeds: ``[n, k, d]`` L2-normalized embeddings (never gathered: they are this process's queries' own).
        valid: ``[n, k]`` bool, False where a row has fewer than ``k`` (those slots score nothing).
    """

    embeds: torch.Tensor
    valid: torch.Tensor


Term = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, HardNegatives | None]


def same_image_pairs(image_keys: torch.Tensor, *, gather: bool = False, group: Any = None) -> torch.Tensor:
    """``[n, N]`` True where candidate ``j`` (of every process's rows, with global negatives) shows the image of this
    process's row ``i`` but is not its own pair."""
    rows = image_keys.shape[0]
    world = distributed_world(group) if gather else 1
    all_keys, offset, _ = gather_rows(image_keys, group) if world > 1 else (image_keys, 0, rows)
    same = image_keys.unsqueeze(1) == all_keys.unsqueeze(0)
    own = torch.arange(rows, device=same.device)
    same[own, own + offset] = False
    return same


def under_autocast(tensor: torch.Tensor) -> bool:
    """Whether autocast is on for ``tensor``'s device. A model's own loss (CLIP's, BridgeTower's) would then take
    its similarity logits from a bf16 matmul (about 3 significant digits: 0.06 at a logit of 14); the families compute
    it with ``info_nce`` instead, whose logits are float32 from the same embeddings (on the tiny BridgeTower, 14x
    closer to the float32 loss)."""
    return torch.is_autocast_enabled(tensor.device.type)


def info_nce(
    terms: Sequence[Term],
    logit_scale: torch.Tensor,
    *,
    gather: bool = False,
    group: Any = None,
    image_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean of one-directional InfoNCE terms, in float32 whatever the autocast state.

    Args:
        terms: ``(queries, candidates)`` pairs of ``[n, d]`` L2-normalized embeddings of this process's batch; row
            ``i`` of both belongs to pair ``i``. A candidate tensor used by several terms is gathered once. A
            third element, ``HardNegatives``, adds per-query candidates to that term (hard negatives).
        logit_scale: The multiplier of the cosine similarities (``exp`` of a model's logit-scale parameter).
        gather: Score against the candidates of every process of ``group`` (global negatives). Without an
            initialized process group, or with one process, this is the local loss.
        group: Process group to gather over (default: the world).
        image_keys: ``[n]`` int64, which image each row shows: a candidate showing a query's image (other than
            its own pair) is left out of that query's softmax. ``None``: every row a different image.

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
        same_image = None if image_keys is None else same_image_pairs(image_keys, gather=gather, group=group)
        total_loss = first.new_zeros((), dtype=torch.float32)
        total = rows
        for term in terms:
            queries, candidates = term[0], term[1]
            hard_negatives = term[2] if len(term) > 2 else None
            key = id(candidates)
            if key not in gathered:
                candidates_f = candidates.float()
                gathered[key] = gather_with_grad(candidates_f, group) if world > 1 else (candidates_f, 0, rows)
            all_candidates, offset, total = gathered[key]
            labels = torch.arange(offset, offset + rows, device=first.device)
            logits = queries.float() @ all_candidates.t() * scale
            if same_image is not None:  # after scaling, as for hard negatives below
                logits = logits.masked_fill(same_image, float("-inf"))
            if hard_negatives is not None:
                logits = torch.cat([logits, hard_negative_logits(queries.float(), hard_negatives, scale)], dim=1)
            total_loss = total_loss + F.cross_entropy(logits, labels, reduction="sum")
        return total_loss / len(terms) * (world / total)


def embed_hard_negatives(
    encode_text: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> HardNegatives:
    """Embed a batch's hard negatives (``[n, k, L]`` token ids and mask, see ``vlfit.data.hard_negatives``).

    Only the slots that hold a caption go through the text encoder: a padded slot attends to no token, and its
    embedding (NaN in some attention kernels) would poison the gradient even where the loss masks it out.
    """
    rows, slots, length = input_ids.shape
    valid = attention_mask.bool().any(dim=-1)
    flat_valid = valid.reshape(-1)
    ids = input_ids.reshape(rows * slots, length)[flat_valid]
    mask = attention_mask.reshape(rows * slots, length)[flat_valid]
    if not len(ids):
        # The text tower still runs, on one token weighed by nothing, so every process calls the same layers
        # (FSDP gathers their weights inside the calls).
        one = input_ids[:1, 0, :1]
        unweighed = encode_text(one, torch.ones_like(one)).sum() * 0
        return HardNegatives(input_ids.new_zeros((rows, slots, 1), dtype=torch.float32) + unweighed, valid)
    embeds = encode_text(ids, mask)
    laid_out = embeds.new_zeros((rows * slots, embeds.shape[-1])).index_copy(0, flat_valid.nonzero().squeeze(1), embeds)
    return HardNegatives(laid_out.view(rows, slots, -1), valid)


# Where a family's ``loss_embeddings`` keeps a batch's hard negatives among its per-pair rows.
HARD_NEGATIVE_ROWS = ("hard_negatives", "hard_negatives_valid")


def add_hard_negatives(
    rows: dict[str, torch.Tensor],
    inputs: Mapping[str, torch.Tensor],
    encode_text: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Embed the batch's hard negatives (when ``inputs`` hold them) into ``rows``, under ``HARD_NEGATIVE_ROWS``."""
    if HARD_NEGATIVE_INPUT_IDS in inputs:
        hard = embed_hard_negatives(encode_text, inputs[HARD_NEGATIVE_INPUT_IDS], inputs[HARD_NEGATIVE_ATTENTION_MASK])
        rows.update(zip(HARD_NEGATIVE_ROWS, (hard.embeds, hard.valid), strict=True))


def add_image_keys(rows: dict[str, torch.Tensor], inputs: Mapping[str, torch.Tensor]) -> None:
    """Carry the batch's image keys (when ``inputs`` hold them) into ``rows``: chunked like the embeddings."""
    if IMAGE_KEYS in inputs:
        rows[IMAGE_KEYS] = inputs[IMAGE_KEYS]


def image_keys_in(rows: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The image keys ``add_image_keys`` put into ``rows``, or None."""
    return rows.get(IMAGE_KEYS)


def hard_negatives_in(rows: Mapping[str, torch.Tensor]) -> HardNegatives | None:
    """The hard negatives ``add_hard_negatives`` put into ``rows``, or None."""
    embeds, valid = HARD_NEGATIVE_ROWS
    return HardNegatives(rows[embeds], rows[valid]) if embeds in rows else None


def hard_negative_logits(queries: torch.Tensor, hard_negatives: HardNegatives, scale: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` scaled cosine similarities of each query with its own hard negatives; ``-inf`` at invalid slots.

    Masked after scaling: the scale's gradient is the logits, and ``0 * -inf`` would make it NaN.
    """
    similarity = torch.einsum("nd,nkd->nk", queries, hard_negatives.embeds.to(queries.dtype)) * scale
    return similarity.masked_fill(~hard_negatives.valid, float("-inf"))
