"""The samples a benchmark cycles through, and what each pipeline reads.

By default the samples are synthetic New-Yorker-like JPEGs (``vlfit.data.synthetic``) held in memory, so a sweep
needs no download, and every machine reads them the same way. ``--dataset_name``, ``--train_file`` and the other
data-location flags of ``vlfit train`` read any source it reads instead. The ``prepared`` pipeline runs the same
samples through ``vlfit.data.prepare.prepare_dataset`` at the model's image size once, into a cache folder, and
reads the parquet shards back like ``vlfit train --dataset_name prepared/`` does.

A sweep decodes ``num_samples`` distinct images and serves them cyclically: decoding the same bytes again costs
the same as decoding new ones, since nothing in the pipeline caches pixels.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from vlfit.data.memory_source import MemorySource
from vlfit.data.prepare import prepare_dataset
from vlfit.data.records import EVAL_COLUMNS, Record
from vlfit.data.sources import open_splits
from vlfit.data.synthetic import SyntheticConfig, make_record
from vlfit.errors import DataError


def _synthetic_record(index: int, config: SyntheticConfig) -> Record:
    row = make_record(index, config)
    return Record(
        id=row["instance_id"],
        image=row["image"]["bytes"],
        caption=row["image_description"],
        extra={name: row[name] for name in EVAL_COLUMNS},
    )


def synthetic_source(
    num_samples: int,
    *,
    seed: int = 0,
    min_long_side: int = 600,
    max_long_side: int = 1400,
    num_proc: int = 1,
) -> MemorySource:
    """Generate ``num_samples`` synthetic New-Yorker-like samples in memory.

    Args:
        num_samples: Distinct samples to make.
        seed: Base seed; each record depends only on it and its index.
        min_long_side: Smallest long side of an image in pixels.
        max_long_side: Largest long side of an image in pixels.
        num_proc: Processes that render images.

    Returns:
        The samples, ids ``synthetic-{seed}-{index}``.
    """
    if num_samples < 1:
        raise DataError(f"--num_samples must be at least 1, got {num_samples}")
    config = SyntheticConfig(
        num_samples=max(num_samples, 3),
        validation_fraction=0.0,
        test_fraction=0.0,
        seed=seed,
        min_long_side=min_long_side,
        max_long_side=max_long_side,
    )
    make = functools.partial(_synthetic_record, config=config)
    workers = max(1, min(num_proc, num_samples // 8))
    if workers == 1:
        records = [make(i) for i in range(num_samples)]
    else:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers) as pool:
            records = pool.map(make, range(num_samples), chunksize=max(1, num_samples // (4 * workers)))
    name = f"synthetic seed {seed}, {num_samples} images, long side {min_long_side}-{max_long_side} px"
    return MemorySource(records, name)


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


def prepared_source(source: Any, *, image_size: int, cache_dir: str, key: str, num_proc: int = 1) -> Any:
    """``source`` re-encoded by ``prepare_dataset`` at ``image_size`` (kept in ``cache_dir``), read back as parquet.

    A folder from an earlier run with the same key is reused (``prepare_dataset`` resumes and checks settings).
    """
    output_dir = os.path.join(cache_dir, f"prepared-{image_size}px-{key}")
    prepare_dataset(
        {"train": source},
        output_dir,
        short_side=image_size,
        num_proc=max(1, min(num_proc, len(source) // 64)),
        source_description={"bench_source": key},
        progress=False,
    )
    return open_splits(
        dataset_name=output_dir, cache_dir=os.path.join(cache_dir, "hf-datasets"), extra_columns=EVAL_COLUMNS
    )["train"]
