"""Offline re-encoding of a dataset at training resolution into local parquet shards (``vlfit prepare``).

``prepare_dataset`` checks the output folder against its manifest, plans the shards of every split, builds the
missing ones and sums up the run. The steps live beside it: ``resolution`` (the short side), ``columns`` (output
schema), ``reencode`` (one image), ``shards`` (one shard, the worker pool), ``manifest`` (the folder's record) and
``report`` (the summary).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from vlfit.data.bad_samples import BAD_SAMPLES_REPORT, check_bad_sample_policy
from vlfit.data.prepare.columns import DEFAULT_EXTRA_COLUMNS, output_columns
from vlfit.data.prepare.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    ManifestMismatchError,
    check_compatible,
    check_empty,
    entry_skipped,
    read_manifest,
    remove_temp_files,
    shard_entry,
    shard_is_complete,
    skipped_samples,
    write_manifest,
)
from vlfit.data.prepare.reencode import CHROMA_SUBSAMPLING, DEFAULT_JPEG_QUALITY, JPEG_ENCODER
from vlfit.data.prepare.report import PrepareSummary, write_bad_samples
from vlfit.data.prepare.shards import (
    DEFAULT_SHARD_SIZE,
    BuiltShard,
    PrepareError,
    ShardSettings,
    ShardStats,
    ShardTask,
    build_shards,
    shard_file_name,
)
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import DataError, failed_write_error


def prepare_dataset(
    sources: Mapping[str, ImageTextSource],
    output_dir: str,
    *,
    short_side: int,
    jpeg_quality: int = DEFAULT_JPEG_QUALITY,
    shard_size: int = DEFAULT_SHARD_SIZE,
    num_proc: int = 1,
    image_column: str = "image",
    caption_column: str = "image_description",
    id_column: str | None = None,
    extra_columns: Sequence[str] = DEFAULT_EXTRA_COLUMNS,
    image_id_column: str | None = None,
    source_description: Mapping[str, Any] | None = None,
    bad_sample_policy: str = "skip",
    progress: bool = True,
    patch_budget: tuple[int, int] | None = None,
) -> PrepareSummary:
    """Re-encode every split at ``short_side`` into parquet shards under ``output_dir``, resuming earlier runs.

    Shards whose file exists with the expected row count (and whose counts the manifest holds) are kept; the rest
    are built, in ``num_proc`` processes. The manifest is rewritten after every shard. An empty split gets no
    shard (so it does not appear when the folder is read back).

    Bad samples (see ``vlfit.data.bad_samples``) are, with ``skip``, left out of their shard, counted per split
    in the summary and the manifest, and listed in ``output_dir/bad_samples.jsonl`` (written at the end, over
    every split the folder holds). With ``raise``, the first one stops the run; so does one that an earlier
    ``skip`` run left out of a shard this run would keep.

    Args:
        sources: Split name -> source, opened with the column arguments below (and ``extra_columns``).
        output_dir: Target folder (created if missing). Must be empty or hold an earlier run with the same settings.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality, 1..100.
        shard_size: Samples per shard.
        num_proc: Worker processes; 1 works in this process.
        image_column: Image column of the source and the output.
        caption_column: Caption column of the source and the output.
        id_column: Id column the source was opened with (see ``output_columns``).
        extra_columns: Extra columns to copy when present.
        image_id_column: Image id column the sources were opened with: written along under its name, so the
            shards group captions into images as the source does (read them back with the same flag).
        source_description: Where the data came from (flags, paths); compared on resumption. Defaults to the
            sources' names.
        bad_sample_policy: ``skip`` or ``raise``. Not a setting compared on resumption: a run stopped by
            ``raise`` can be finished with ``skip``.
        progress: Show a progress bar over samples.
        patch_budget: A NaFlex model's ``(patch_size, max_num_patches)``: each image is stored at its patch grid
            (``vlfit.data.prepare.reencode.prepare_grid_image``) instead of at ``short_side``; compared on resumption.

    Returns:
        The counts of the run.

    Raises:
        ValueError: for a setting out of range.
        ManifestMismatchError: when ``output_dir`` holds other data or an earlier run with other settings, or a
            split's row count changed since.
        PrepareError: with ``raise``, naming the split, the sample and the reason of the first bad sample.
    """
    for name, value, low in (("short_side", short_side, 1), ("shard_size", shard_size, 1), ("num_proc", num_proc, 1)):
        if value < low:
            raise DataError(f"--{name} must be at least {low}, got {value}")
    if not 1 <= jpeg_quality <= 100:
        raise DataError(f"--jpeg_quality must be in 1..100, got {jpeg_quality}")
    check_bad_sample_policy(bad_sample_policy)
    if not sources:
        raise DataError("no splits to prepare")
    started = time.perf_counter()
    output_dir = os.path.abspath(output_dir)
    description = dict(source_description or {split: source.name for split, source in sources.items()})
    settings = {
        "short_side": short_side,
        "jpeg_quality": jpeg_quality,
        "chroma_subsampling": CHROMA_SUBSAMPLING,
        "shard_size": shard_size,
        "columns": {
            "image": image_column,
            "caption": caption_column,
            "id": id_column,
            "extra": list(extra_columns),
        },
        "source": description,
    }
    if patch_budget is not None:  # a NaFlex model's images, stored at their patch grid
        settings["patch_grid"] = {"patch_size": patch_budget[0], "max_num_patches": patch_budget[1],
                                  "chroma_subsampling": "4:4:4"}  # fmt: skip
    if image_id_column is not None:  # only then: a folder prepared before the setting existed still resumes
        settings["columns"]["image_id"] = image_id_column

    os.makedirs(output_dir, exist_ok=True)
    manifest_path = os.path.join(output_dir, MANIFEST_NAME)
    manifest = read_manifest(manifest_path)
    if manifest is None:
        check_empty(output_dir)
        manifest = {"format_version": MANIFEST_VERSION, "settings": settings, "splits": {}}
    else:
        check_compatible(output_dir, manifest, settings)
    manifest["encoder"] = JPEG_ENCODER

    tasks: list[ShardTask] = []
    for split, source in sources.items():
        rows = len(source)
        # An empty split gets no shard: the datasets parquet reader fails on a file without rows.
        num_shards = math.ceil(rows / shard_size)
        earlier = manifest["splits"].get(split)
        if earlier is not None and earlier.get("rows") != rows:
            raise ManifestMismatchError(
                f"{output_dir}: split {split!r} has {rows} rows now but {earlier.get('rows')} when it was "
                "prepared: the source changed; pick a new --output_dir"
            )
        columns = output_columns(
            split,
            source,
            image_column=image_column,
            caption_column=caption_column,
            id_column=id_column,
            extra_columns=extra_columns,
            image_id_column=image_id_column,
        )
        names = [shard_file_name(split, i, num_shards) for i in range(num_shards)]
        kept = (earlier or {}).get("shards", {})
        manifest["splits"][split] = {
            "rows": rows,
            "num_shards": num_shards,
            "source_name": source.name,
            "columns": {
                "image": columns.image,
                "caption": columns.caption,
                "id": columns.id,
                **({"image_id": columns.image_id} if columns.image_id else {}),
            },  # fmt: skip
            "extra_columns": list(columns.extras),
            "bad_samples": 0,
            "shards": {n: kept[n] for n in names if n in kept},
        }
        for i, file_name in enumerate(names):
            start, stop = i * shard_size, min((i + 1) * shard_size, rows)
            tasks.append(ShardTask(split, i, num_shards, start, stop, file_name, columns))
    remove_temp_files(output_dir)

    def done(task: ShardTask) -> bool:
        entry = manifest["splits"][task.split]["shards"].get(task.file_name)
        return shard_is_complete(os.path.join(output_dir, task.file_name), entry, task.num_samples)

    todo = [task for task in tasks if not done(task)]
    for task in todo:
        manifest["splits"][task.split]["shards"].pop(task.file_name, None)
    for split in sources:
        _count_bad_samples(manifest, split)
    if bad_sample_policy == "raise":
        _raise_for_kept_bad_sample(manifest, list(sources))
    manifest["complete"] = not todo
    built: list[str] = []
    samples_built = sum(task.num_samples for task in todo)
    bar = tqdm(total=samples_built, unit="img", desc="prepare", disable=not progress or not todo)

    def record(shard: BuiltShard) -> None:
        task = shard.task
        shards = manifest["splits"][task.split]["shards"]
        shards[task.file_name] = shard_entry(shard.stats, shard.skipped)
        manifest["splits"][task.split]["shards"] = dict(sorted(shards.items()))  # workers finish in any order
        _count_bad_samples(manifest, task.split)
        built.append(task.file_name)
        manifest["complete"] = len(built) == len(todo)
        write_manifest(manifest_path, manifest)
        bar.update(task.num_samples)

    bad_samples_path = os.path.join(output_dir, BAD_SAMPLES_REPORT)
    with _failed_writes_in_one_line(output_dir, manifest, list(sources), len(tasks)):
        write_manifest(manifest_path, manifest)
        try:
            shard_settings = ShardSettings(output_dir, short_side, jpeg_quality, bad_sample_policy, patch_budget)
            build_shards(todo, sources, shard_settings, num_proc=num_proc, on_done=record)
        finally:
            bar.close()
            remove_temp_files(output_dir)  # a failed run's workers may leave partial files behind
        # Over every split the folder holds, so that preparing splits in separate runs keeps the whole list.
        write_bad_samples(bad_samples_path, skipped_samples(manifest))
    totals = ShardStats()
    for split in sources:
        for entry in manifest["splits"][split]["shards"].values():
            totals.add(ShardStats.from_entry(entry))
    return PrepareSummary(
        output_dir=output_dir,
        short_side=short_side,
        jpeg_quality=jpeg_quality,
        split_rows={split: len(source) for split, source in sources.items()},
        totals=totals,
        shards_total=len(tasks),
        shards_built=len(built),
        samples_built=samples_built,
        elapsed_s=time.perf_counter() - started,
        built_shards=sorted(built),
        bad_samples={split: manifest["splits"][split]["bad_samples"] for split in sources},
        bad_samples_path=bad_samples_path,
        patch_budget=patch_budget,
    )


@contextlib.contextmanager
def _failed_writes_in_one_line(
    output_dir: str, manifest: Mapping[str, Any], splits: Sequence[str], shards: int
) -> Iterator[None]:
    """A write inside the block that fails for want of space (``vlfit.errors.failed_write_error``) ends in one line:
    the folder, its free space, about what the shards left of ``splits`` need (those built so far, on average) and
    the shards kept, which the same command run again keeps."""
    try:
        yield
    except Exception as error:
        listed = [entry for split in splits for entry in manifest["splits"][split]["shards"].values()]
        sizes = [ShardStats.from_entry(entry).output_bytes for entry in listed]
        needed = sum(sizes) // len(sizes) * (shards - len(listed)) if sizes else None
        note = f"the folder keeps the {len(listed)} of {shards} shards its {MANIFEST_NAME} lists"
        remedy = "free space there and run the same command again to resume"
        failure = failed_write_error(error, output_dir, needed=needed or None, note=note, remedy=remedy)
        if failure is None:
            raise
        raise failure from error


def _count_bad_samples(manifest: dict[str, Any], split: str) -> None:
    info = manifest["splits"][split]
    info["bad_samples"] = sum(ShardStats.from_entry(entry).skipped for entry in info["shards"].values())


def _raise_for_kept_bad_sample(manifest: Mapping[str, Any], splits: Sequence[str]) -> None:
    """Under ``raise``, a kept shard that an earlier ``skip`` run left a sample out of stops the run too."""
    for split in splits:
        for name, entry in sorted(manifest["splits"][split]["shards"].items()):
            for bad in entry_skipped(split, entry):
                reason = f"{bad.reason} (left out of {name} by an earlier run with --bad_sample_policy skip)"
                raise PrepareError.in_split(split, bad.id, reason)
