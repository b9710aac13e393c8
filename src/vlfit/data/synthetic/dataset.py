"""Synthetic rows and datasets: one record from ``(seed, index)``, the splits in memory, and writing them to disk."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import datasets
import numpy as np

from vlfit.atomic_files import staged_folder, write_text_atomically
from vlfit.data.synthetic.render import render_scene
from vlfit.data.synthetic.scenes import (
    LABEL_CLASSES,
    LETTERS,
    REGIONS,
    SPLITS,
    SyntheticConfig,
    caption,
    scene_and_choices,
    split_sizes,
)
from vlfit.errors import DataError
from vlfit.output_folders import MAKE_DATA, SYNTHETIC_SETTINGS

SETTINGS_FILE = SYNTHETIC_SETTINGS  # what a dataset was made with (``save_dataset``'s ``settings``)
FEATURES = datasets.Features(
    {
        "image": datasets.Image(),
        "image_description": datasets.Value("string"),
        "caption_choices": datasets.List(datasets.Value("string")),
        "label": datasets.Value("string"),
        "instance_id": datasets.Value("string"),
    }
)


def features(config: SyntheticConfig) -> datasets.Features:
    """The columns of a dataset made with ``config``: ``FEATURES``, and for a labelled set its class column (a
    ``ClassLabel`` named after the attribute)."""
    if not config.labels:
        return FEATURES
    return datasets.Features({**FEATURES, config.labels: datasets.ClassLabel(names=list(LABEL_CLASSES[config.labels]))})


def make_record(index: int, config: SyntheticConfig) -> dict[str, Any]:
    """Build one row; it depends only on ``config.seed``, ``index`` and the image settings.

    Args:
        index: Row index over the whole dataset (train rows first, then validation, then test).
        config: Dataset settings.

    Returns:
        A dict with ``image`` (``{"bytes": jpeg, "path": None}``), ``image_description`` (the true caption),
        ``caption_choices`` (5 distinct captions), ``label`` (letter of the true one) and ``instance_id``; with
        ``config.labels``, also that attribute's column (the index of the scene's value in ``LABEL_CLASSES``).
    """
    rng = np.random.default_rng([config.seed, index])
    scene, choices, answer = scene_and_choices(rng, shared=config.labels, grammar=config.caption_grammar)
    jpeg = render_scene(scene, rng, config)
    record = {
        "image": {"bytes": jpeg, "path": None},
        "image_description": caption(scene, config.caption_grammar),
        "caption_choices": choices,
        "label": LETTERS[answer],
        "instance_id": f"synthetic-{config.seed}-{index:07d}",
    }
    if config.labels:
        values = REGIONS if config.labels == "region" else LABEL_CLASSES[config.labels]
        record[config.labels] = values.index(getattr(scene[0], config.labels))
    return record


def make_dataset(config: SyntheticConfig, num_proc: int = 1) -> datasets.DatasetDict:
    """Generate the train / validation / test splits in memory.

    Rows are contiguous index ranges (train first); each row is seeded from ``(seed, index)``, so the output is
    byte-identical for any ``num_proc``.

    Args:
        config: Dataset settings.
        num_proc: Worker processes used for generation.

    Returns:
        A ``DatasetDict`` with the splits in ``SPLITS``, features ``features(config)``.
    """
    return generate_splits(config, features(config), make_record, num_proc)


def generate_splits(
    config: SyntheticConfig,
    split_features: datasets.Features,
    make_record: Callable[[int, SyntheticConfig], dict[str, Any]],
    num_proc: int = 1,
    what: str = "",
) -> datasets.DatasetDict:
    """The splits in ``SPLITS`` (sizes as ``split_sizes``), each row made by ``make_record(index, config)`` from its
    split's contiguous index range (train first), so rows are the same for any ``num_proc``.

    Raises:
        DataError: for a ``num_proc`` below 1.
    """
    if num_proc < 1:
        raise DataError(f"--num_proc must be at least 1, got {num_proc}")
    splits = {}
    start = 0
    for name, size in split_sizes(config).items():
        indices = datasets.Dataset.from_dict({"index": list(range(start, start + size))})
        start += size
        if size == 0:
            splits[name] = datasets.Dataset.from_dict({k: [] for k in split_features}, features=split_features)
            continue
        splits[name] = indices.map(
            _record_batch,
            batched=True,
            batch_size=16,
            fn_kwargs={"config": config, "make_record": make_record, "columns": list(split_features)},
            remove_columns=["index"],
            features=split_features,
            num_proc=min(num_proc, size),
            keep_in_memory=True,
            desc=f"Generating {name}{what}",
        )
    return datasets.DatasetDict({name: splits[name] for name in SPLITS})


def _record_batch(
    batch: dict[str, list],
    config: SyntheticConfig,
    make_record: Callable[[int, SyntheticConfig], dict[str, Any]],
    columns: list[str],
) -> dict[str, list]:
    """The rows of a batch of indices, as ``columns``."""
    rows = [make_record(int(i), config) for i in batch["index"]]
    return {name: [row[name] for row in rows] for name in columns}


def claim_dataset_folder(output_dir: str, flag: str = "--output_dir") -> None:
    """Refuse, before anything is generated, a folder ``save_dataset`` would refuse (``claim_folder``)."""
    MAKE_DATA.claim(output_dir, flag)


def save_dataset(
    dataset_dict: datasets.DatasetDict,
    output_dir: str,
    format: str = "arrow",
    *,
    settings: dict[str, Any] | None = None,
) -> list[str]:
    """Write a dataset to disk, whole or not at all (``vlfit.atomic_files.staged_folder``): a folder that holds
    anything but an earlier synthetic dataset is refused before anything is written, and an earlier one is replaced.

    Args:
        dataset_dict: The splits to write.
        output_dir: Target folder (created if missing).
        format: ``"arrow"`` for a ``save_to_disk`` folder (read back with ``datasets.load_from_disk``), or
            ``"parquet"`` for one ``{split}.parquet`` file per split.
        settings: What the dataset was made with, written last as ``SETTINGS_FILE`` (a folder that holds it is
            complete: ``vlfit demo`` reuses it).

    Returns:
        The written paths: the folder for ``"arrow"``, one file per split for ``"parquet"``. Splits without rows
        are not written (``datasets`` cannot load an empty split back from disk).

    Raises:
        DataError: for an unknown format.
        ConfigError: ``output_dir`` is a file, or a folder that holds other files.
    """
    if format not in ("arrow", "parquet"):
        raise DataError(f"unknown format {format!r}; choose one of 'arrow', 'parquet'")
    dataset_dict = datasets.DatasetDict({name: split for name, split in dataset_dict.items() if len(split)})
    with staged_folder(
        output_dir,
        MAKE_DATA.command,
        what="the dataset",
        record_name=SETTINGS_FILE,
        names=MAKE_DATA.names,
    ) as staging:
        if format == "arrow":
            dataset_dict.save_to_disk(staging)
        for name, split in dataset_dict.items() if format == "parquet" else ():
            split.to_parquet(os.path.join(staging, f"{name}.parquet"))
        if settings is not None:
            write_text_atomically(os.path.join(staging, SETTINGS_FILE), json.dumps(settings))
    if format == "arrow":
        return [output_dir]
    return [os.path.join(output_dir, f"{name}.parquet") for name in dataset_dict]
