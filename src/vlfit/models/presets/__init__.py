"""Presets: architectures built with random weights, one JSON file each (``<name>.json`` in this folder).

The shipped ones have the shapes of the real checkpoints (``large``: BridgeTower/bridgetower-large-itm-mlm-itc,
``clip-base``: openai/clip-vit-base-patch32, ...) or are small enough to train on a CPU. ``list_presets`` lists
this folder, ``add_preset`` adds a file from elsewhere, and ``--model_preset`` takes a name or a file's path. A
preset file holds one JSON object:

- ``family`` (required): ``bridgetower``, ``clip``, ``metaclip2``, ``siglip``, ``siglip2`` or ``two-tower``
  (``vlfit.models.registry``).
- ``config`` (required): the keyword arguments of the family's transformers config (``BridgeTowerConfig``,
  ``CLIPConfig``, ``MetaClip2Config``, ``SiglipConfig``), the towers' as ``text_config`` and ``vision_config`` objects.
- ``image_processor`` (required): the settings of a transformers image processor (its ``image_mean`` and
  ``image_std`` are what the input pipeline normalizes with), its class named by ``image_processor_type``.
- ``tokenizer_vocab_size``: size of the byte-level BPE trained on the captions when no ``--tokenizer_name`` is
  given (default: the text tower's ``vocab_size``).
- ``vision_position_init``: ``random`` (transformers' init, the default) or ``sincos`` (2D sine-cosine,
  ``vlfit.models.position_embeddings``): models trained from scratch learn where patches are faster from sincos.
- ``description``: one line for people.

Nothing here imports torch or transformers: a command's ``--help`` lists the presets without loading them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from vlfit.errors import ConfigError, MissingFileError, python_api

PRESET_FOLDER = Path(__file__).resolve().parent
REQUIRED_KEYS = ("family", "config", "image_processor")
OPTIONAL_KEYS = ("tokenizer_vocab_size", "vision_position_init", "description")
VISION_POSITION_INITS = ("random", "sincos")


@dataclass(frozen=True)
class Preset:
    """One preset file, read and checked (see the module doc for its keys).

    Attributes:
        name: The file's name without ``.json``.
        family: The family that builds it.
        config: Keyword arguments of the family's transformers config.
        image_processor: Settings of the image processor, ``image_processor_type`` naming its class.
        tokenizer_vocab_size: The trained tokenizer's size, or None for the text tower's vocabulary.
        vision_position_init: ``random`` or ``sincos``.
        description: One line for people.
        path: The file it was read from.
    """

    name: str
    family: str
    config: dict[str, Any] = field(repr=False)
    image_processor: dict[str, Any] = field(repr=False)
    tokenizer_vocab_size: int | None
    vision_position_init: str
    description: str
    path: Path


def read_preset(path: str | os.PathLike[str], *, flag: str = "--model_preset") -> Preset:
    """Read and check a preset file.

    Args:
        path: A ``.json`` file.
        flag: How the caller passed it, named in errors.

    Raises:
        MissingFileError: no such file.
        ConfigError: the file is not a preset: not JSON, not an object, a key missing, unknown or of the wrong type.
    """
    path = Path(path)
    if path.suffix != ".json":
        raise ConfigError(f"{flag} {path}: a preset file is a .json file (see vlfit.models.presets)")
    if not path.is_file():
        raise MissingFileError(f"{flag} {path}: no such preset file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{flag} {path}: cannot read the preset ({error})") from error
    where = f"{flag} {path}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a preset is a JSON object with keys {', '.join(REQUIRED_KEYS)}")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise ConfigError(f"{where}: the preset has no {', '.join(missing)}; it needs {', '.join(REQUIRED_KEYS)}")
    unknown = sorted(set(data) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown preset key(s) {', '.join(unknown)}; "
            f"a preset has {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)} (model settings go in 'config')"
        )
    _check_type(where, data, "family", str)
    _check_type(where, data, "config", dict)
    _check_type(where, data, "image_processor", dict)
    _check_type(where, data, "description", str)
    _check_type(where, data, "vision_position_init", str)
    vocab = data.get("tokenizer_vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise ConfigError(f"{where}: tokenizer_vocab_size must be a positive integer, got {vocab!r}")
    position_init = data.get("vision_position_init", "random")
    if position_init not in VISION_POSITION_INITS:
        raise ConfigError(
            f"{where}: unknown vision_position_init {position_init!r}; "
            f"choose one of: {', '.join(VISION_POSITION_INITS)}"
        )
    if not isinstance(data["image_processor"].get("image_processor_type"), str):
        raise ConfigError(f"{where}: image_processor needs image_processor_type, its class (e.g. CLIPImageProcessor)")
    return Preset(
        name=path.stem,
        family=data["family"],
        config=data["config"],
        image_processor=data["image_processor"],
        tokenizer_vocab_size=vocab,
        vision_position_init=position_init,
        description=data.get("description", ""),
        path=path,
    )


def _check_type(where: str, data: dict[str, Any], key: str, kind: type) -> None:
    if key in data and not isinstance(data[key], kind):
        wanted = {str: "a string", dict: "a JSON object"}[kind]
        raise ConfigError(f"{where}: {key} must be {wanted}, got {type(data[key]).__name__}")


@cache
def _shipped() -> dict[str, Preset]:
    return {path.stem: read_preset(path) for path in sorted(PRESET_FOLDER.glob("*.json"))}


_added: dict[str, Preset] = {}


def _all() -> dict[str, Preset]:
    return {**_shipped(), **_added}


def _order(preset: Preset) -> tuple[Any, ...]:
    """Family, then smallest first: the towers' widths, then their depths, then the name."""
    towers = [preset.config.get(tower, {}) for tower in ("text_config", "vision_config")]
    width = sum(int(tower.get("hidden_size", 0)) for tower in towers if isinstance(tower, dict))
    depth = sum(int(tower.get("num_hidden_layers", 0)) for tower in towers if isinstance(tower, dict))
    return preset.family, width, depth, preset.name


@python_api
def list_presets() -> list[str]:
    """The names of every preset: the shipped ones and those ``add_preset`` added, by family, smallest first."""
    return [preset.name for preset in sorted(_all().values(), key=_order)]


@python_api
def add_preset(path: str | os.PathLike[str]) -> str:
    """Add the preset in ``path`` (a ``.json`` file as the shipped ones are), named after the file.

    Then ``--model_preset <name>``, ``vlfit.load(<name>)`` and ``list_presets`` know it in this process (a command
    also takes the file's path as ``--model_preset`` directly).

    Returns:
        The preset's name.

    Raises:
        ConfigError: the file is not a preset, or another preset has its name.
        MissingFileError: no such file.
    """
    preset = read_preset(path, flag="--path")  # worded `path=...` for the Python caller (python_api)
    known = _all().get(preset.name)
    if known is not None and known.path.resolve() != preset.path.resolve():
        raise ConfigError(
            f"--path {preset.path}: a preset named {preset.name!r} exists already ({known.path}); rename the file"
        )
    _added[preset.name] = preset
    return preset.name


def is_preset_file(value: str) -> bool:
    """Whether ``--model_preset`` names a file rather than a preset (it ends in ``.json``)."""
    return value.endswith(".json")


def get_preset(name: str) -> Preset:
    """The preset named ``name`` (shipped or added), or read from ``name`` when it is a ``.json`` file's path.

    Raises:
        ConfigError: an unknown name, listing the presets; a file that is not a preset.
        MissingFileError: a ``.json`` path with no file.
    """
    presets = _all()
    if name in presets:
        return presets[name]
    if is_preset_file(name):
        return read_preset(name)  # read again at each call: a few hundred bytes, and never a stale copy
    raise ConfigError(
        f"unknown --model_preset {name!r}; choose one of: {', '.join(list_presets())} "
        "(or give the path of a preset .json file)"
    )
