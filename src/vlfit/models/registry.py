"""The model families vlfit knows, looked up by a checkpoint's ``config.model_type`` or by a preset's name.

Adding a family: implement ``vlfit.models.family.ModelFamily`` in a module of its own and list an instance in
``FAMILIES``. Nothing else changes: loading, training, evaluation and the bench reach it through this registry.
"""

from __future__ import annotations

from typing import Any

from vlfit.errors import ConfigError
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.clip import CLIPFamily
from vlfit.models.family import ModelFamily
from vlfit.models.siglip import SiglipFamily

FAMILIES: tuple[ModelFamily, ...] = (BridgeTowerFamily(), CLIPFamily(), SiglipFamily())


def preset_names() -> list[str]:
    """Every preset of every family."""
    return [name for family in FAMILIES for name in family.preset_names()]


def family_for_preset(preset: str) -> ModelFamily:
    """The family that builds ``preset``.

    Raises:
        ValueError: naming the unknown preset and listing the valid ones.
    """
    for family in FAMILIES:
        if preset in family.preset_names():
            return family
    raise ConfigError(f"unknown --model_preset {preset!r}; choose one of: {', '.join(preset_names())}")


def family_for_config(config: Any) -> ModelFamily:
    """The family of a checkpoint with ``config`` (a transformers ``PretrainedConfig``).

    Raises:
        ValueError: for a model type no family handles, listing those that are supported.
    """
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for family in FAMILIES for t in family.model_types)
    raise ConfigError(f"model type {model_type!r} is not supported; vlfit fine-tunes: {supported}")
