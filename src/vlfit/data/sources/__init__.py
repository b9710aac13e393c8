"""Every map-style source and the one way to open them (``openers``).

- ``base``: ``ImageTextSource``, the interface (records of encoded image bytes and captions, ids and captions read
  without images); the column rules every reader shares are ``vlfit.data.columns``.
- ``arrow``: hub datasets, ``save_to_disk`` folders, parquet, JSON lines and CSV (``ArrowSource``).
- ``tar``: WebDataset tar shards read in place (``TarSource``), and shards at URLs to index (``ShardCollection``);
  the naming rules both tar readers follow are ``vlfit.data.webdataset``.
- ``images``: an image folder (``ImageFolderSource``) and image files (``ImageFilesSource``).
- ``memory``: records held in memory (``MemorySource``); ``synthetic``: synthetic scenes made in memory.
- ``labelled``: labelled splits (``LabelledSplit``) and zero-shot sets (``ZeroShotSet``).
- ``locations``: what a dataset name or folder holds and which source reads each split.
- ``openers``: ``open_splits`` / ``open_split``, ``open_collection``, ``labelled_splits`` / ``open_zeroshot_sets``
  and ``open_run_data``.

The names are importable from here (``from vlfit.data.sources import open_splits``); each loads its module on first
use, so importing the package loads nothing heavy (the datasets library comes with ``arrow``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULES = {
    "ImageTextSource": "base",
    "ArrowSource": "arrow",
    "TarSource": "tar",
    "ShardCollection": "tar",
    "ImageFilesSource": "images",
    "ImageFolderSource": "images",
    "MemorySource": "memory",
    "synthetic_source": "synthetic",
    "LabelledSplit": "labelled",
    "ZeroShotSet": "labelled",
    "labelled_splits": "openers",
    "open_zeroshot_sets": "openers",
    "COLLECTION_KEYS": "openers",
    "RunData": "openers",
    "open_collection": "openers",
    "open_run_data": "openers",
    "open_split": "openers",
    "open_splits": "openers",
}

__all__ = [
    "ArrowSource",
    "COLLECTION_KEYS",
    "ImageFilesSource",
    "ImageFolderSource",
    "ImageTextSource",
    "LabelledSplit",
    "MemorySource",
    "RunData",
    "ShardCollection",
    "TarSource",
    "ZeroShotSet",
    "labelled_splits",
    "open_collection",
    "open_run_data",
    "open_split",
    "open_splits",
    "open_zeroshot_sets",
    "synthetic_source",
]

if TYPE_CHECKING:
    from vlfit.data.sources.arrow import ArrowSource
    from vlfit.data.sources.base import ImageTextSource
    from vlfit.data.sources.images import ImageFilesSource, ImageFolderSource
    from vlfit.data.sources.labelled import LabelledSplit, ZeroShotSet
    from vlfit.data.sources.memory import MemorySource
    from vlfit.data.sources.openers import (
        COLLECTION_KEYS,
        RunData,
        labelled_splits,
        open_collection,
        open_run_data,
        open_split,
        open_splits,
        open_zeroshot_sets,
    )
    from vlfit.data.sources.synthetic import synthetic_source
    from vlfit.data.sources.tar import ShardCollection, TarSource


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
