"""Activation (gradient) checkpointing for models whose transformers class does not provide it.

``--gradient_checkpointing`` (``--activation_checkpointing``) makes the Trainer call the model's
``activation_checkpointing_enable``; transformers refuses it for classes with ``supports_gradient_checkpointing =
False``, BridgeTower among them, although its layers are plain residual blocks. ``install`` gives such a model an
``activation_checkpointing_enable`` of its own that wraps the layers a model family names (every transformer block
of every tower) in ``torch.utils.checkpoint``: their activations are recomputed in the backward instead of kept.

The wrapped ``forward`` is set on each layer instance, so module hooks (DDP's, FSDP's) stay outside the checkpoint,
and it checkpoints only in training mode with gradients enabled: evaluation runs the layers as they are. Dropout
draws the same masks in the recompute (``preserve_rng_state``), so a step computes the same loss and gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from vlfit.errors import ConfigError

_UNWRAPPED_FORWARD = "_vlfit_forward_without_checkpointing"


def checkpoint_layers(
    layers: Sequence[nn.Module],
    *,
    every_n_layers: int = 1,
    offload: bool = False,
    checkpoint_kwargs: dict[str, Any] | None = None,
) -> int:
    """Wrap the forward of every ``every_n_layers``-th layer (the first included) in ``checkpoint``.

    Args:
        layers: The blocks to checkpoint, in order.
        every_n_layers: Checkpoint one layer in this many; the others keep their activations.
        offload: Keep the inputs saved for the recompute in pinned host memory instead of on the device.
        checkpoint_kwargs: Extra ``torch.utils.checkpoint.checkpoint`` arguments (default ``use_reentrant=False``).

    Returns:
        How many layers are checkpointed. Calling again re-wraps from the original forwards.
    """
    if every_n_layers < 1:
        raise ConfigError(f"every_n_layers must be at least 1, got {every_n_layers}")
    kwargs = {"use_reentrant": False, **(checkpoint_kwargs or {})}
    uncheckpoint_layers(layers)
    wrapped = 0
    for index, layer in enumerate(layers):
        if index % every_n_layers:
            continue
        forward = layer.forward
        setattr(layer, _UNWRAPPED_FORWARD, forward)
        layer.forward = _checkpointed(layer, forward, offload, kwargs)
        wrapped += 1
    return wrapped


def uncheckpoint_layers(layers: Sequence[nn.Module]) -> None:
    """Give ``layers`` their original forward back (a no-op for layers never wrapped)."""
    for layer in layers:
        if _UNWRAPPED_FORWARD in vars(layer):
            del layer.forward
            delattr(layer, _UNWRAPPED_FORWARD)


def _checkpointed(layer: nn.Module, forward: Callable, offload: bool, kwargs: dict[str, Any]) -> Callable:
    def forward_with_checkpointing(*args: Any, **layer_kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **layer_kwargs)
        saving = save_on_cpu(pin_memory=torch.cuda.is_available()) if offload else contextlib.nullcontext()
        with saving:
            return checkpoint(forward, *args, **kwargs, **layer_kwargs)

    return forward_with_checkpointing


def install(model: nn.Module, stacks: Callable[[nn.Module], Sequence[Sequence[nn.Module]]]) -> None:
    """Give ``model`` the ``activation_checkpointing_enable``/``_disable`` the Trainer calls.

    ``stacks(model)`` lists the model's layer stacks (one per tower); ``every_n_layers`` counts within each.

    The Trainer passes ``activation_checkpointing_kwargs`` (``--gradient_checkpointing_kwargs``) with
    ``every_n_layers`` and ``offload`` already taken out; the rest go to ``torch.utils.checkpoint.checkpoint``.
    """

    def enable(
        activation_checkpointing_kwargs: dict[str, Any] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
        gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    ) -> None:
        for layers in stacks(model):
            checkpoint_layers(
                layers,
                every_n_layers=every_n_layers,
                offload=offload,
                checkpoint_kwargs=activation_checkpointing_kwargs or gradient_checkpointing_kwargs,
            )

    def disable() -> None:
        for layers in stacks(model):
            uncheckpoint_layers(layers)

    for name, method in (
        ("activation_checkpointing_enable", enable),
        ("gradient_checkpointing_enable", enable),
        ("activation_checkpointing_disable", disable),
        ("gradient_checkpointing_disable", disable),
    ):
        setattr(model, name, method)
