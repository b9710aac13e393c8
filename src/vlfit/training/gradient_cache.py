"""``--gradient_cache_chunk_size N``: contrastive batches larger than memory, with the gradient of the whole batch.

A contrastive loss couples every pair of the batch, so it cannot be split into independent micro-batches the way
gradient accumulation splits a token loss. Gradient caching (Gao et al., "Scaling Deep Contrastive Learning Batch
Size under Memory Limited Setup", 2021) splits the *model* instead:

1. every chunk of ``N`` pairs goes through the model without gradient (no activations kept), giving everything the
   family's loss is computed from (``ModelFamily.loss_embeddings``: the embeddings of each term, BridgeTower's
   cross-modal ones included, hard negatives, the temperature);
2. the loss of the whole batch (global with ``--contrastive_negatives global``) is computed from those, and its
   gradient with respect to each of them is taken (cheap: no model in that graph);
3. each chunk goes through the model again, with gradient, and back-propagates ``sum(embedding * its cached
   gradient)``, whose parameter gradient is exactly that chunk's share of the whole batch's.

The random state is saved before each chunk's first pass and restored before its second, so dropout draws the
same masks both times. Under DDP every chunk but the last runs in ``no_sync``: gradients are reduced once per step.
Tensors the batch shares (the temperature) back-propagate their gradient with the last chunk only, so DDP sees
their gradient arrive in the step that reduces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlfit.models.family import LOCAL_LOSS, LossEmbeddings, LossScope, ModelFamily


def split_rows(inputs: Mapping[str, torch.Tensor], chunk_size: int) -> list[dict[str, torch.Tensor]]:
    """The batch's inputs (every one row-major: ``[B, ...]``) in chunks of ``chunk_size`` rows."""
    rows = next(iter(inputs.values())).shape[0]
    return [
        {key: value[start : start + chunk_size] for key, value in inputs.items()}
        for start in range(0, rows, chunk_size)
    ]


@dataclass
class RandomState:
    """The CPU generator's state and, when a CUDA device computes, that device's."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RandomState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


def _concatenate(parts: list[LossEmbeddings]) -> LossEmbeddings:
    rows = {}
    for key in parts[0].rows:
        values = [part.rows[key] for part in parts]
        if values[0].ndim > 1:  # per-row vectors; one value per row (image keys) needs no widening
            widest = max(value.shape[-1] for value in values)
            # A chunk none of whose rows has a hard negative embeds none: its (all-masked) slots have width 1.
            values = [
                value if value.shape[-1] == widest else value.new_zeros((*value.shape[:-1], widest)) for value in values
            ]
        rows[key] = torch.cat(values)
    return LossEmbeddings(rows, dict(parts[0].shared))


def _leaves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies that collect gradients (floating-point ones; masks stay constants)."""
    return {key: value.detach().requires_grad_(value.is_floating_point()) for key, value in tensors.items()}


def _surrogate(part: LossEmbeddings, grads: Mapping[str, torch.Tensor | None], start: int, with_shared: bool,
               shared_grads: Mapping[str, torch.Tensor | None]) -> torch.Tensor | None:  # fmt: skip
    """``sum(tensor * cached gradient)`` over one chunk's tensors: its backward is the chunk's parameter gradient."""
    total = None
    for key, value in part.rows.items():
        grad = grads.get(key)
        if grad is None:
            continue
        term = (value.float() * grad[start : start + value.shape[0]].float()).sum()
        total = term if total is None else total + term
    if with_shared:
        for key, value in part.shared.items():
            grad = shared_grads.get(key)
            if grad is not None:
                term = (value.float() * grad.float()).sum()
                total = term if total is None else total + term
    return total


def gradient_cached_backward(
    family: ModelFamily,
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    chunk_size: int,
    *,
    scope: LossScope = LOCAL_LOSS,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Accumulate into ``model``'s parameters the gradient of the whole batch's contrastive loss, ``chunk_size``
    pairs at a time; returns the loss (detached).

    Args:
        family: The model's family (``loss_embeddings`` / ``loss_from_embeddings``).
        model: The model as training calls it (DDP-wrapped in a multi-process run).
        inputs: The batch's model inputs on the device (and hard negatives), every one ``[B, ...]``.
        chunk_size: Pairs per forward pass.
        scope: Which negatives and terms (``vlfit.models.family.LossScope``).
        backward: Back-propagates a scalar (the Trainer passes ``accelerator.backward``, which scales for fp16).
        no_sync: A context in which DDP skips its gradient reduction (``accelerator.no_sync(model)``).
        device: Where the model computes (default: the inputs' device), for the random state.
    """
    chunks = split_rows(inputs, chunk_size)
    device = device or next(iter(inputs.values())).device
    states: list[RandomState] = []
    parts: list[LossEmbeddings] = []
    with torch.no_grad():
        for chunk in chunks:
            states.append(RandomState.capture(device))
            parts.append(family.loss_embeddings(model, chunk))
    after = RandomState.capture(device)
    whole = _concatenate(parts)
    rows, shared = _leaves(whole.rows), _leaves(whole.shared)
    loss = family.loss_from_embeddings(LossEmbeddings(rows, shared), scope)
    loss.backward()  # the graph holds no parameter: gradients land on the leaves only
    row_grads = {key: value.grad for key, value in rows.items()}
    shared_grads = {key: value.grad for key, value in shared.items()}
    start = 0
    for index, (chunk, state) in enumerate(zip(chunks, states, strict=True)):
        last = index == len(chunks) - 1
        state.restore(device)
        with contextlib.nullcontext() if last else no_sync():
            part = family.loss_embeddings(model, chunk)
            surrogate = _surrogate(part, row_grads, start, last, shared_grads)
            if surrogate is not None:
                backward(surrogate)
        start += next(iter(chunk.values())).shape[0]
    after.restore(device)  # the generator moves on as after one pass over the batch
    return loss.detach()
