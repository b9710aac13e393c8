"""The samples a benchmark cycles through, and what each pipeline reads.

By default the samples are synthetic New-Yorker-like JPEGs held in memory (``vlfit.data.sources.synthetic``), so a
sweep needs no download, and every machine reads them the same way. ``--dataset_name``, ``--train_file`` and the other
data-location flags of ``vlfit train`` read any source it reads instead. The ``prepared`` pipeline runs the same
samples through ``vlfit.data.prepare.prepare_dataset`` at the model's image size once, into a cache folder, and
reads the parquet shards back like ``vlfit train --dataset_name prepared/`` does.

A sweep decodes ``num_samples`` distinct images and serves them cyclically: decoding the same bytes again costs
the same as decoding new ones, since nothing in the pipeline caches pixels.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from vlfit.data.prepare import prepare_dataset
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.sources.openers import open_splits
from vlfit.errors import DataError


def dataset_source(
    location: Mapping[str, Any],
    *,
    split: str,
    num_samples: int,
    cache_dir: str | None = None,
    token: str | None = None,
) -> Any:
    """The first ``num_samples`` records of one split of any source ``vlfit train`` reads.

    Args:
        location: The data-location and column flags (``DataLocationArguments.source_kwargs()``): dataset name,
            config and revision, data files, image, caption and id columns.
        split: The split to read.
        num_samples: Records to take from its start.
        cache_dir: Where the datasets library caches downloads (``--cache_dir``).
        token: Hub token (``--token``).

    Raises:
        DataError: when the split is missing or empty.
    """
    splits = open_splits(**location, cache_dir=cache_dir, token=token, extra_columns=EVAL_COLUMNS)
    if split not in splits:
        raise DataError(f"split {split!r} not found; the data has: {', '.join(splits) or 'none'}")
    source = splits[split]
    if len(source) == 0:
        raise DataError(f"split {split!r} is empty")
    return source.select(range(min(num_samples, len(source))))


def cycled(source: Any, length: int) -> Any:
    """``source`` repeated until it holds ``length`` records (index ``i`` serves record ``i % len(source)``)."""
    return source.select(np.arange(length, dtype=np.int64) % len(source))


def source_key(description: dict[str, Any]) -> str:
    """A short stable name for a source description (cache folder names)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def prepared_source(
    source: Any,
    *,
    image_size: int,
    cache_dir: str,
    key: str,
    num_proc: int = 1,
    patch_budget: tuple[int, int] | None = None,
) -> Any:
    """``source`` re-encoded by ``prepare_dataset`` at ``image_size`` (a NaFlex model's: at the patch grids of
    ``patch_budget``; kept in ``cache_dir``), read back as parquet.

    A folder from an earlier run with the same key is reused (``prepare_dataset`` resumes and checks settings).
    """
    size = f"{image_size}px" if patch_budget is None else f"grid{patch_budget[1]}x{patch_budget[0]}px"
    output_dir = os.path.join(cache_dir, f"prepared-{size}-{key}")
    prepare_dataset(
        {"train": source},
        output_dir,
        short_side=image_size,
        num_proc=max(1, min(num_proc, len(source) // 64)),
        source_description={"bench_source": key},
        progress=False,
        patch_budget=patch_budget,
    )
    return open_splits(
        dataset_name=output_dir, cache_dir=os.path.join(cache_dir, "hf-datasets"), extra_columns=EVAL_COLUMNS
    )["train"]
