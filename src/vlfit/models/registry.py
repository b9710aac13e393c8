"""The model families vlfit knows, looked up by a checkpoint's ``config.model_type`` or by a preset's ``family``.

Adding a family: implement ``vlfit.models.family.ModelFamily`` in a module of its own and list an instance in
``FAMILIES``; its presets are JSON files in ``vlfit.models.presets``. Nothing else changes: loading, training,
evaluation and the bench reach it through this registry.
"""

from __future__ import annotations

from typing import Any

from vlfit.errors import ConfigError
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.clip import CLIPFamily, MetaClip2Family
from vlfit.models.family import ModelFamily
from vlfit.models.presets import get_preset
from vlfit.models.siglip import SiglipFamily
from vlfit.models.siglip2 import Siglip2Family
from vlfit.models.two_tower import TwoTowerFamily
from vlfit.models.vqa import VqaFamily, is_vqa_config

FAMILIES: tuple[ModelFamily, ...] = (
    BridgeTowerFamily(),
    CLIPFamily(),
    MetaClip2Family(),
    SiglipFamily(),
    Siglip2Family(),
    TwoTowerFamily(),
)


def family_for_preset(preset: str) -> ModelFamily:
    """The family that builds ``preset`` (a preset's name or a preset file's path).

    Raises:
        ConfigError: naming the unknown preset and listing the valid ones, or a preset of an unknown family.
        MissingFileError: a ``.json`` path with no file.
    """
    found = get_preset(preset)
    for family in FAMILIES:
        if family.name == found.family:
            return family
    names = ", ".join(family.name for family in FAMILIES)
    raise ConfigError(f"preset {preset} ({found.path}): unknown family {found.family!r}; choose one of: {names}")


def preset_config(preset: str) -> Any:
    """The transformers config of ``preset``, built by its family."""
    return family_for_preset(preset).preset_config(preset)


def family_for_config(config: Any) -> ModelFamily:
    """The family of a checkpoint with ``config`` (a transformers ``PretrainedConfig``): ``VqaFamily`` for a VQA
    model's (its architectures name ``BridgeTowerForQuestionAnswering``), else the family of its model type.

    Raises:
        ValueError: for a model type no family handles, listing those that are supported.
    """
    if is_vqa_config(config):  # a BridgeTower that answers questions (vlfit train --task vqa)
        return VqaFamily()
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for family in FAMILIES for t in family.model_types)
    raise ConfigError(f"model type {model_type!r} is not supported; vlfit fine-tunes: {supported}")
