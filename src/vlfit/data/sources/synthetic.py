"""Synthetic captioned scenes made in memory (``vlfit.data.synthetic``'s, as ``vlfit make-data`` writes them): the
samples a benchmark cycles through by default, and export's parity and calibration samples without a dataset."""

from __future__ import annotations

import functools
import multiprocessing

from vlfit.data.records import EVAL_COLUMNS, Record
from vlfit.data.sources.memory import MemorySource
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
    """``num_samples`` synthetic New-Yorker-like samples in memory.

    Args:
        num_samples: Distinct samples to make.
        seed: Base seed; each record depends only on it and its index.
        min_long_side: Smallest long side of an image in pixels.
        max_long_side: Largest long side of an image in pixels.
        num_proc: Processes that render images.

    Returns:
        The samples, ids ``synthetic-{seed}-{index}``, with the evaluation columns (``EVAL_COLUMNS``).

    Raises:
        DataError: when ``num_samples`` is below 1.
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
