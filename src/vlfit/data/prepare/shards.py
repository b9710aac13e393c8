"""Building the shards of ``vlfit prepare``: one shard (read, re-encode, write), and the pool that runs them all."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from vlfit.atomic_files import replace_on_success
from vlfit.data.prepare.columns import OutputColumns
from vlfit.data.prepare.reencode import prepare_image
from vlfit.data.source_base import ImageTextSource
from vlfit.threads import torch_threads

DEFAULT_SHARD_SIZE = 1000
# Rows per parquet row group: small, so a reader never has to buffer many images at once.
_ROW_GROUP_SIZE = 100

# What to do with a sample that cannot be read or decoded. Only "raise" exists; a skip policy would also have to
# record the skipped ids in the manifest, since resumption checks each shard's row count.
ErrorPolicy = Literal["raise"]


class PrepareError(ValueError):
    """A sample cannot be prepared; the message names the split, the sample id and the row."""


@dataclass(frozen=True)
class ShardTask:
    """One shard to build: rows ``start`` to ``stop`` of ``split``, written to ``file_name``.

    Args:
        split: Split name.
        index: Shard number within the split.
        num_shards: Shards of the split.
        start: First source row.
        stop: One past the last source row.
        file_name: The shard's file name in the output folder.
        columns: The split's output columns.
    """

    split: str
    index: int
    num_shards: int
    start: int
    stop: int
    file_name: str
    columns: OutputColumns


@dataclass
class ShardStats:
    """Counts for one written shard (stored in the manifest).

    Args:
        rows: Samples in the shard.
        input_bytes: Stored image bytes read from the source.
        output_bytes: Size of the shard file.
        image_bytes: Re-encoded image bytes (``output_bytes`` less captions, ids and parquet overhead).
        source_pixels: Full-size pixels of the source images.
        decoded_pixels: Pixels decoded from the source images (after DCT scaling).
        output_pixels: Pixels of the output images.
        small_images: Images whose short side was already at or below the target, kept at their size.
    """

    rows: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    image_bytes: int = 0
    source_pixels: int = 0
    decoded_pixels: int = 0
    output_pixels: int = 0
    small_images: int = 0

    def add(self, other: ShardStats) -> None:
        """Add another shard's counts to these."""
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


def shard_file_name(split: str, index: int, num_shards: int) -> str:
    """The file name of shard ``index`` of ``num_shards`` of ``split`` (the hub's naming, read back by split)."""
    return f"{split}-{index:05d}-of-{num_shards:05d}.parquet"


def _sample_error(policy: ErrorPolicy, split: str, row: int, sample_id: str | None, err: Exception) -> None:
    """Handle a sample that failed to read or decode: ``"raise"`` stops the run naming the sample.

    The one place a skip policy would go (it would return, and the shard would hold fewer rows).
    """
    who = f"sample {sample_id!r}" if sample_id is not None else "a sample"
    raise PrepareError(f"cannot prepare {who} of split {split!r} (row {row}): {err}") from err


def build_shard(
    task: ShardTask,
    source: ImageTextSource,
    output_dir: str,
    short_side: int,
    jpeg_quality: int,
    on_error: ErrorPolicy = "raise",
) -> ShardStats:
    """Re-encode the rows of one shard and write them to ``output_dir/task.file_name``.

    Args:
        task: The shard.
        source: The split's source.
        output_dir: The output folder.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality.
        on_error: What to do with a sample that cannot be read or decoded.

    Returns:
        The shard's counts.

    Raises:
        PrepareError: naming the split and sample when an image cannot be read or decoded.
    """
    cols = task.columns
    values: dict[str, list[Any]] = {name: [] for name in (cols.image, cols.caption, cols.id, *cols.extras)}
    stats = ShardStats()
    for row in range(task.start, task.stop):
        sample_id = None
        try:
            record = source[row]
            sample_id = record.id
            prepared = prepare_image(record.image, short_side, jpeg_quality, record.id)
        except Exception as err:  # any failure, reported with the sample it belongs to
            _sample_error(on_error, task.split, row, sample_id, err)
            continue
        values[cols.image].append({"bytes": prepared.data, "path": None})
        values[cols.caption].append(record.caption)
        values[cols.id].append(record.id)
        for name in cols.extras:
            values[name].append(record.extra.get(name))
        stats.rows += 1
        stats.input_bytes += len(record.image)
        stats.image_bytes += len(prepared.data)
        stats.source_pixels += prepared.source_pixels
        stats.decoded_pixels += prepared.decoded_pixels
        stats.output_pixels += prepared.width * prepared.height
        stats.small_images += prepared.small
    table = pa.Table.from_pydict(cols.features.encode_batch(values), schema=cols.features.arrow_schema)
    final = os.path.join(output_dir, task.file_name)
    # A shard file either is complete or does not exist; the temporary name is hidden and does not end in
    # .parquet, so readers of the folder never pick up a partial shard.
    with replace_on_success(final) as temp:
        pq.write_table(table, temp, row_group_size=_ROW_GROUP_SIZE)
    stats.output_bytes = os.path.getsize(final)
    return stats


# Per-worker state, set by the pool initializer (inherited without pickling when the pool forks).
_WORKER: dict[str, Any] = {}


def _init_worker(sources: Mapping[str, ImageTextSource], output_dir: str, short_side: int, jpeg_quality: int) -> None:
    torch.set_num_threads(1)  # one process per core already; intra-op threads would only contend
    _WORKER.update(sources=sources, output_dir=output_dir, short_side=short_side, jpeg_quality=jpeg_quality)


def _run_task(task: ShardTask) -> tuple[ShardTask, ShardStats]:
    state = _WORKER
    stats = build_shard(
        task, state["sources"][task.split], state["output_dir"], state["short_side"], state["jpeg_quality"]
    )
    return task, stats


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork shares the opened sources with the workers for free; spawn pickles them (memory-mapped data by path).
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def build_shards(
    tasks: Sequence[ShardTask],
    sources: Mapping[str, ImageTextSource],
    output_dir: str,
    *,
    short_side: int,
    jpeg_quality: int,
    num_proc: int,
    on_done: Callable[[ShardTask, ShardStats], None],
) -> None:
    """Build every shard of ``tasks``, in this process or in ``num_proc`` worker processes.

    Args:
        tasks: The shards to build.
        sources: Split name -> source.
        output_dir: The output folder.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality.
        num_proc: Worker processes; 1 builds in this process.
        on_done: Called in this process with each shard as it completes (in any order with several workers).
    """
    workers = min(num_proc, len(tasks))
    if workers <= 1:
        with torch_threads(1):
            for task in tasks:
                on_done(task, build_shard(task, sources[task.split], output_dir, short_side, jpeg_quality))
        return
    init_args = (dict(sources), output_dir, short_side, jpeg_quality)
    with _pool_context().Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        for task, stats in pool.imap_unordered(_run_task, tasks):
            on_done(task, stats)
