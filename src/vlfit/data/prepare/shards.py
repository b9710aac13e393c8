"""Building the shards of ``vlfit prepare``: one shard (read, check, re-encode, write), and the pool that runs them.

A bad sample (unreadable record, undecodable image, missing/empty/whitespace caption; see
``vlfit.data.bad_samples``) is left out of its shard and returned with the shard under ``--bad_sample_policy
skip``, and stops the run with ``PrepareError`` under ``raise``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from vlfit.atomic_files import replace_on_success
from vlfit.data.bad_samples import RAISE_HINT, BadCaptionError, BadSampleError, clean_caption, describe_error
from vlfit.data.decode import DecodeError
from vlfit.data.prepare.columns import OutputColumns
from vlfit.data.prepare.reencode import prepare_image
from vlfit.data.records import BadRecordError
from vlfit.data.sources.base import ImageTextSource
from vlfit.threads import torch_threads

DEFAULT_SHARD_SIZE = 1000
# Rows per parquet row group: small, so a reader never has to buffer many images at once.
_ROW_GROUP_SIZE = 100
# What makes a sample bad rather than the run broken: these are skipped (or raised as PrepareError) by the policy.
_BAD_SAMPLE_ERRORS = (BadRecordError, DecodeError, BadCaptionError)


class PrepareError(BadSampleError):
    """A bad sample under ``--bad_sample_policy raise``; the message names the split, the sample, the reason and
    what to do about it.

    Attributes:
        split: The sample's split (besides ``sample_id`` and ``reason``).
    """

    def __init__(
        self, message: str, sample_id: str | None = None, reason: str | None = None, split: str | None = None
    ) -> None:
        super().__init__(message, sample_id, reason)
        self.split = split

    @classmethod
    def in_split(cls, split: str, sample_id: str, reason: str, row: int | None = None) -> PrepareError:
        """``cannot prepare sample <id> of split <split> (row <row>): <reason>. <hint>``."""
        where = f" (row {row})" if row is not None else ""
        message = f"cannot prepare sample {sample_id!r} of split {split!r}{where}: {reason}. {RAISE_HINT}"
        return cls(message, sample_id, reason, split)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the attributes when a worker process sends the error to the main process.
        return type(self), (str(self), self.sample_id, self.reason, self.split)


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

    @property
    def num_samples(self) -> int:
        """Source samples the shard covers (written or left out as bad)."""
        return self.stop - self.start


@dataclass(frozen=True)
class ShardSettings:
    """What every shard of a run is built with.

    Args:
        output_dir: The output folder.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality.
        bad_sample_policy: ``skip`` (leave bad samples out) or ``raise`` (stop at the first one).
        patch_budget: A NaFlex model's ``(patch_size, max_num_patches)``: images are stored at their patch grid.
    """

    output_dir: str
    short_side: int
    jpeg_quality: int
    bad_sample_policy: str = "skip"
    patch_budget: tuple[int, int] | None = None


@dataclass
class ShardStats:
    """Counts for one shard (stored in the manifest).

    Args:
        rows: Samples written to the shard.
        skipped: Bad samples left out of it.
        input_bytes: Stored image bytes read from the source.
        output_bytes: Size of the shard file.
        image_bytes: Re-encoded image bytes (``output_bytes`` less captions, ids and parquet overhead).
        source_pixels: Full-size pixels of the source images.
        decoded_pixels: Pixels decoded from the source images (after DCT scaling).
        output_pixels: Pixels of the output images.
        small_images: Images whose short side was already at or below the target, kept at their size.
    """

    rows: int = 0
    skipped: int = 0
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

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> ShardStats:
        """The counts of a manifest shard entry (other keys are ignored; missing counts are 0)."""
        return cls(**{f.name: int(entry.get(f.name, 0)) for f in fields(cls)})


@dataclass(frozen=True)
class SkippedSample:
    """A bad sample left out of the output: one line of ``bad_samples.jsonl``.

    Args:
        split: Its split.
        id: Its id (``row N`` when the record could not be read far enough to know it).
        reason: What is wrong with it.
    """

    split: str
    id: str
    reason: str


@dataclass
class BuiltShard:
    """A shard written by ``build_shard``: its task, its counts and the bad samples left out of it, in row order."""

    task: ShardTask
    stats: ShardStats
    skipped: list[SkippedSample] = field(default_factory=list)


def shard_file_name(split: str, index: int, num_shards: int) -> str:
    """The file name of shard ``index`` of ``num_shards`` of ``split`` (the hub's naming, read back by split)."""
    return f"{split}-{index:05d}-of-{num_shards:05d}.parquet"


def build_shard(task: ShardTask, source: ImageTextSource, settings: ShardSettings) -> BuiltShard:
    """Re-encode the rows of one shard and write them to ``settings.output_dir/task.file_name``.

    A shard whose samples are all bad gets no file (like an empty split: the parquet reader fails on a file
    without rows).

    Args:
        task: The shard.
        source: The split's source.
        settings: Output settings and the bad-sample policy.

    Returns:
        The shard's counts and the bad samples left out of it.

    Raises:
        PrepareError: under ``raise``, naming the split, the sample and the reason at the first bad sample.
    """
    cols = task.columns
    names = (cols.image, cols.caption, cols.id, *cols.extras, *([cols.image_id] if cols.image_id else []))
    values: dict[str, list[Any]] = {name: [] for name in names}
    built = BuiltShard(task, ShardStats())
    stats = built.stats
    for row in range(task.start, task.stop):
        try:
            record = source[row]
            # The caption is checked first: it is free, and a bad one makes decoding the image pointless.
            caption = clean_caption(record.caption, record.id)
            prepared = prepare_image(
                record.image, settings.short_side, settings.jpeg_quality, record.id, settings.patch_budget
            )
        except _BAD_SAMPLE_ERRORS as err:
            sample_id, reason = describe_error(err, fallback_id=f"row {row}")
            if settings.bad_sample_policy == "raise":
                raise PrepareError.in_split(task.split, sample_id, reason, row) from err
            built.skipped.append(SkippedSample(task.split, sample_id, reason))
            stats.skipped += 1
            continue
        except Exception as err:  # not the data's fault: stop, but say where
            err.add_note(f"while preparing row {row} of split {task.split!r}")
            raise
        values[cols.image].append({"bytes": prepared.data, "path": None})
        values[cols.caption].append(caption)
        values[cols.id].append(record.id)
        for name in cols.extras:
            values[name].append(record.extra.get(name))
        if cols.image_id:
            values[cols.image_id].append(record.image_id)
        stats.rows += 1
        stats.input_bytes += len(record.image)
        stats.image_bytes += len(prepared.data)
        stats.source_pixels += prepared.source_pixels
        stats.decoded_pixels += prepared.decoded_pixels
        stats.output_pixels += prepared.width * prepared.height
        stats.small_images += prepared.small
    final = os.path.join(settings.output_dir, task.file_name)
    if not stats.rows:
        with contextlib.suppress(FileNotFoundError):
            os.remove(final)
        return built
    table = pa.Table.from_pydict(cols.features.encode_batch(values), schema=cols.features.arrow_schema)
    # A shard file either is complete or does not exist; the temporary name is hidden and does not end in
    # .parquet, so readers of the folder never pick up a partial shard.
    with replace_on_success(final) as temp:
        pq.write_table(table, temp, row_group_size=_ROW_GROUP_SIZE)
    stats.output_bytes = os.path.getsize(final)
    return built


# Per-worker state, set by the pool initializer (inherited without pickling when the pool forks).
_WORKER: dict[str, Any] = {}


def _init_worker(sources: Mapping[str, ImageTextSource], settings: ShardSettings) -> None:
    torch.set_num_threads(1)  # one process per core already; intra-op threads would only contend
    _WORKER.update(sources=sources, settings=settings)


def _run_task(task: ShardTask) -> BuiltShard:
    return build_shard(task, _WORKER["sources"][task.split], _WORKER["settings"])


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork shares the opened sources with the workers for free; spawn pickles them (memory-mapped data by path).
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def build_shards(
    tasks: Sequence[ShardTask],
    sources: Mapping[str, ImageTextSource],
    settings: ShardSettings,
    *,
    num_proc: int,
    on_done: Callable[[BuiltShard], None],
) -> None:
    """Build every shard of ``tasks``, in this process or in ``num_proc`` worker processes.

    Args:
        tasks: The shards to build.
        sources: Split name -> source.
        settings: Output settings and the bad-sample policy.
        num_proc: Worker processes; 1 builds in this process.
        on_done: Called in this process with each shard as it completes (in any order with several workers).

    Raises:
        PrepareError: under ``raise``, at the first bad sample of any worker.
    """
    workers = min(num_proc, len(tasks))
    if workers <= 1:
        with torch_threads(1):
            for task in tasks:
                on_done(build_shard(task, sources[task.split], settings))
        return
    # An executor, not multiprocessing.Pool: it hands a worker a shard only as one is free, and on an error
    # (a bad sample under raise) cancels the shards not started. Pool queues every task at once and, leaving on an
    # error, waited once in CI for 14 minutes on its task thread, blocked writing tasks to workers it had stopped.
    with ProcessPoolExecutor(workers, mp_context=_pool_context(), initializer=_init_worker,
                             initargs=(dict(sources), settings)) as pool:  # fmt: skip
        pending = [pool.submit(_run_task, task) for task in tasks]
        try:
            for future in as_completed(pending):
                on_done(future.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # the shards being built finish; no other starts
            raise
