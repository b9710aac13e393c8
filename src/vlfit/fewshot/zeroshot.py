"""Zero-shot classification: each class's text embedding, from its name in several prompt templates, averaged as
CLIP does (the mean of the normalized embeddings, normalized again)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from vlfit.errors import ConfigError
from vlfit.models.logit_scale import logit_scale_parameter

DEFAULT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.",
    "a drawing of a {}.",
    "a picture of a {}.",
    "an image of a {}.",
    "a {}.",
)
# The softmax temperature's inverse when the model has no logit scale (CLIP's largest).
DEFAULT_SCALE = 100.0


def check_templates(templates: Sequence[str]) -> None:
    """Raises ``ValueError`` for a template without exactly one ``{}``."""
    if not templates:
        raise ConfigError("--prompt_template: give at least one template, e.g. 'a photo of a {}.'")
    for template in templates:
        if template.count("{}") != 1:
            raise ConfigError(f"--prompt_template {template!r} must hold '{{}}' once: where the class name goes")


def class_embeddings(
    embed_texts: Callable[[list[str]], torch.Tensor], class_names: Sequence[str], templates: Sequence[str]
) -> torch.Tensor:
    """``float32 [C, D]``: per class, the normalized mean of its prompts' normalized text embeddings.

    Args:
        embed_texts: Texts -> their L2-normalized embeddings (an ``Encoder``'s ``embed_texts``, or a model's).
        class_names: The classes.
        templates: The prompts, ``{}`` the class name.
    """
    check_templates(templates)
    rows = []
    for name in class_names:
        prompts = embed_texts([template.format(name) for template in templates])
        rows.append(nn.functional.normalize(prompts.float().mean(dim=0), dim=-1))
    return torch.stack(rows)


def model_scale(model: nn.Module) -> float:
    """The model's logit scale multiplier (``exp`` of its parameter, at most 100), or ``DEFAULT_SCALE``."""
    parameter = logit_scale_parameter(model)
    if parameter is None:
        return DEFAULT_SCALE
    return min(DEFAULT_SCALE, math.exp(float(parameter.detach().float())))
