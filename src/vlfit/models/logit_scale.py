"""``--logit_scale_init_value``: where a contrastive model's logit scale starts.

transformers' contrastive models (BridgeTower, CLIP, SigLIP) keep the log of the inverse temperature as a
parameter named ``logit_scale``; its ``exp`` multiplies the cosine similarities of the contrastive loss. Its
initial value comes from the config for a new model and from the checkpoint for a pretrained one; this flag
starts fine-tuning from another value (and records it in the model's config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vlfit.errors import ConfigError

LOGIT_SCALE = "logit_scale"
_HOOK_ATTRIBUTE = "_vlfit_output_hook"


def logit_scale_parameter(model: nn.Module) -> nn.Parameter | None:
    """The model's ``logit_scale`` parameter, or ``None`` when it has none."""
    return dict(model.named_parameters()).get(LOGIT_SCALE)


def set_logit_scale(model: nn.Module, value: float) -> None:
    """Set the model's logit scale (the log of the inverse temperature) to ``value``.

    Raises:
        ValueError: The model has no ``logit_scale`` parameter.
    """
    parameter = logit_scale_parameter(model)
    if parameter is None:
        raise ConfigError(
            f"--logit_scale_init_value: {type(model).__name__} has no {LOGIT_SCALE} parameter to set; drop the flag"
        )
    with torch.no_grad():
        parameter.fill_(value)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "logit_scale_init_value"):
        config.logit_scale_init_value = value


def install_output_hook(model: nn.Module, hook: Callable[[nn.Module, tuple, Any], Any]) -> None:
    """Register ``hook`` as ``model``'s forward hook once (idempotent).

    The families' losses are computed outside the model (global negatives, hard negatives) but need the
    temperature from inside the forward: DDP treats a parameter no forward output depends on as unused, and FSDP
    holds the unsharded parameter only during the forward. The hook returns the output with the scale added.
    """
    if getattr(model, _HOOK_ATTRIBUTE, None) is None:
        setattr(model, _HOOK_ATTRIBUTE, model.register_forward_hook(hook))
