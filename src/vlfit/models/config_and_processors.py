"""The family, config, tokenizer and image processor of a model, without its weights: a checkpoint's (or LoRA
adapters'), a preset's (its tokenizer trained on the training captions) or a model of two pretrained towers'.

What ``vlfit.models.loading.resolve_model`` reads first, before it settles the inputs (caption length, patch budget)
the model is loaded at. ``config_name``, ``tokenizer_name`` and ``image_processor_name`` are the flags that replace
the model's own; ``hub`` the hub settings everything is loaded with (``hub_settings``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from vlfit.errors import ConfigError, ModelLoadError, first_line
from vlfit.models.family import ModelFamily
from vlfit.models.input_spec_file import DEFAULT_MAX_SEQ_LENGTH
from vlfit.models.reference import MODEL_CONFIG
from vlfit.models.registry import family_for_config, family_for_preset
from vlfit.models.tokenizer import train_caption_tokenizer

logger = logging.getLogger(__name__)


class ConfigAndProcessors(NamedTuple):
    """A model's family, transformers config, tokenizer and image processor."""

    family: ModelFamily
    config: Any
    tokenizer: Any
    image_processor: Any


def hub_settings(
    cache_dir: str | None, model_revision: str, token: str | None, trust_remote_code: bool
) -> dict[str, Any]:
    """``--cache_dir``, ``--model_revision``, ``--token`` and ``--trust_remote_code`` as ``from_pretrained``'s
    keywords."""
    kwargs = {"cache_dir": cache_dir, "revision": model_revision, "token": token}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    return kwargs


def checkpoint_config_and_processors(
    checkpoint: str,
    adapters: str | None,
    *,
    config_name: str | None,
    tokenizer_name: str | None,
    image_processor_name: str | None,
    hub: dict[str, Any],
) -> ConfigAndProcessors:
    """A checkpoint's (a folder or hub id); for LoRA ``adapters`` on it, the tokenizer and image processor are the
    adapters' run's, and the config too where the adapters have their own (a VQA run's: its answers)."""
    own = adapters if adapters and os.path.isfile(os.path.join(adapters, MODEL_CONFIG)) else None
    config_source = config_name or own or checkpoint
    try:
        config = AutoConfig.from_pretrained(config_source, **hub)
    except OSError as error:  # not a folder with a config.json, and not a hub id that can be reached
        raise ModelLoadError(
            f"{config_source}: cannot load a model config ({first_line(error, 200)}); "
            "pass a folder with config.json (what vlfit train writes) or a hub id this machine can reach"
        ) from error
    family = family_for_config(config)
    tokenizer = _load_processor(
        AutoTokenizer, "tokenizer", "--tokenizer_name", tokenizer_name or adapters or checkpoint, hub
    )
    image_processor = _load_processor(
        AutoImageProcessor,
        "image processor",
        "--image_processor_name",
        image_processor_name or adapters or checkpoint,
        hub,
    )
    return ConfigAndProcessors(family, config, tokenizer, image_processor)


def preset_config_and_processors(
    preset: str,
    captions: Callable[[], Iterable[str | None]] | None,
    max_seq_length: int | None,
    *,
    config_name: str | None,
    tokenizer_name: str | None,
    image_processor_name: str | None,
    hub: dict[str, Any],
) -> ConfigAndProcessors:
    """A preset's (a name or ``.json`` file); without ``tokenizer_name`` its tokenizer is a byte-level BPE trained
    on ``captions()``, cut at ``max_seq_length`` (None: ``DEFAULT_MAX_SEQ_LENGTH``).

    Raises:
        ConfigError: for neither captions nor ``tokenizer_name``.
    """
    family = family_for_preset(preset)
    config = AutoConfig.from_pretrained(config_name, **hub) if config_name else family.preset_config(preset)
    if tokenizer_name is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, **hub)
    else:
        if captions is None:
            raise ConfigError(f"preset {preset!r} needs training captions or --tokenizer_name")
        logger.info("training a byte-level BPE tokenizer on the training captions (no --tokenizer_name given)")
        tokenizer = train_caption_tokenizer(
            captions(),
            vocab_size=family.preset_tokenizer_vocab_size(preset),
            model_max_length=max_seq_length or DEFAULT_MAX_SEQ_LENGTH,
            special_tokens=family.preset_special_tokens,
        )
    image_processor = (
        AutoImageProcessor.from_pretrained(image_processor_name, **hub)
        if image_processor_name
        else family.preset_image_processor(preset)
    )
    return ConfigAndProcessors(family, config, tokenizer, image_processor)


def two_tower_config_and_processors(
    towers: tuple[str, str],
    projection_dim: int | None,
    *,
    config_name: str | None,
    tokenizer_name: str | None,
    image_processor_name: str | None,
    hub: dict[str, Any],
) -> ConfigAndProcessors:
    """A model of two pretrained towers' (vision, text): its config from the towers' configs (no weights), the text
    tower's tokenizer and the vision tower's image processor.

    Raises:
        ConfigError: for ``config_name``: each tower keeps its own.
    """
    from vlfit.models.two_tower import DEFAULT_PROJECTION_DIM, TwoTowerFamily, tower_config

    if config_name is not None:
        raise ConfigError("--config_name with two towers: each tower keeps its own config; drop --config_name")
    family = TwoTowerFamily()
    vision = tower_config(towers[0], "--vision_model_name_or_path", hub, vision=True)
    text = tower_config(towers[1], "--text_model_name_or_path", hub, vision=False)
    config = family.config_class.from_vision_text_configs(
        vision, text, projection_dim=int(projection_dim or DEFAULT_PROJECTION_DIM)
    )
    tokenizer = _load_processor(AutoTokenizer, "tokenizer", "--tokenizer_name", tokenizer_name or towers[1], hub)
    image_processor = _load_processor(
        AutoImageProcessor, "image processor", "--image_processor_name", image_processor_name or towers[0], hub
    )
    return ConfigAndProcessors(family, config, tokenizer, image_processor)


def _load_processor(auto_class: Any, what: str, flag: str, name_or_path: str, hub: dict[str, Any]) -> Any:
    """``auto_class.from_pretrained``, failing with one line that names what is missing where and ``flag``."""
    try:
        return auto_class.from_pretrained(name_or_path, **hub)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{name_or_path}: cannot load its {what} ({first_line(error, 200)}); save the {what} beside "
            f"the model (vlfit train does) or pass {flag}"
        ) from error
