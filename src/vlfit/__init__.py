"""vlfit: fine-tune vision-language models (BridgeTower, CLIP, SigLIP) on image-text data, then put them to work.

The API (``vlfit.api``): ``load`` a model and ``Model.encode_images`` / ``encode_texts`` / ``similarity``;
``train``, ``evaluate`` and ``merge`` (model soups, Model Stock) with the CLI's flags as keyword arguments (a
``RunResult``); ``Index`` to build, open, append and search an embedding index; ``UserError`` (and its kinds in
``vlfit.errors``) for every mistake of the caller, each naming the keyword argument (``ArgumentError`` for an unknown
keyword or a value of the wrong type).
``list_presets`` and ``add_preset`` (``vlfit.models.presets``): the presets, one JSON file each.
Importing ``vlfit`` is cheap: the API loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlfit.errors import (
    ArgumentError,
    ConfigError,
    DataError,
    MissingExtraError,
    MissingFileError,
    ModelLoadError,
    UserError,
)
from vlfit.version import __version__

__all__ = [
    "ArgumentError",
    "ConfigError",
    "DataError",
    "Index",
    "MissingExtraError",
    "MissingFileError",
    "Model",
    "ModelLoadError",
    "RunResult",
    "SearchHit",
    "UserError",
    "__version__",
    "add_preset",
    "evaluate",
    "list_presets",
    "load",
    "merge",
    "train",
]

_API = {"Index", "Model", "RunResult", "SearchHit", "evaluate", "load", "merge", "train"}
_PRESETS = {"add_preset", "list_presets"}

if TYPE_CHECKING:
    from vlfit.api import Index, Model, RunResult, SearchHit, evaluate, load, merge, train
    from vlfit.models.presets import add_preset, list_presets


def __getattr__(name: str) -> Any:
    if name in _API:
        from vlfit import api

        return getattr(api, name)
    if name in _PRESETS:
        from vlfit.models import presets

        return getattr(presets, name)
    raise AttributeError(f"module 'vlfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
