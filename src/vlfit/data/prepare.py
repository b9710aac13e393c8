"""Offline re-encoding of a dataset at training resolution into local parquet shards (``vlfit prepare``).

Each image is decoded with DCT scaling, resized so its short side equals the training resolution (aspect kept, no
crop, so a random resized crop at train time still sees the whole frame) and re-encoded as a metadata-free 4:2:0
JPEG (``vlfit.data.reencode``). Captions, ids and extra columns are copied unchanged. Training then decodes
several times fewer pixels per sample. The output folder holds ``{split}-{shard:05d}-of-{num_shards:05d}.parquet``
files (the image column is a ``datasets.Image`` feature) and a manifest, and reads back with
``open_splits(dataset_name=output_dir)``.

Runs are resumable: every shard is written to a temporary file and renamed into place when complete, and a re-run
builds only the shards that are missing. A re-run with different settings is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from vlfit.data.reencode import CHROMA_SUBSAMPLING, DEFAULT_JPEG_QUALITY, JPEG_ENCODER, prepare_image
from vlfit.data.source_base import ImageTextSource
from vlfit.data.sources import ArrowSource
from vlfit.threads import torch_threads

MANIFEST_NAME = "vlfit_prepare.json"
MANIFEST_VERSION = 1
# The columns training and evaluation read besides image, caption and id.
DEFAULT_EXTRA_COLUMNS: tuple[str, ...] = ("caption_choices", "label")
DEFAULT_SHARD_SIZE = 1000
# Rows per parquet row group: small, so a reader never has to buffer many images at once.
_ROW_GROUP_SIZE = 100
# Temporary files of shards and of the manifest: `.{final name}.{pid}.tmp`.
_TEMP_FILE = re.compile(r"^\.(.+-\d{5}-of-\d{5}\.parquet|vlfit_prepare\.json)\.\d+\.tmp$")

# What to do with a sample that cannot be read or decoded. Only "raise" exists; a skip policy would also have to
# record the skipped ids in the manifest, since resumption checks each shard's row count.
ErrorPolicy = Literal["raise"]


class PrepareError(ValueError):
    """A sample cannot be prepared; the message names the split, the sample id and the row."""


class ManifestMismatchError(ValueError):
    """The output folder was prepared with other settings or from another source."""


def resolve_short_side(
    short_side: int | None = None,
    model_preset: str | None = None,
    model_name_or_path: str | None = None,
    *,
    cache_dir: str | None = None,
    revision: str = "main",
    token: str | None = None,
) -> int:
    """Find the output short side from exactly one of: a number, a preset, or a checkpoint's vision config.

    Args:
        short_side: The short side in pixels.
        model_preset: A preset name from ``vlfit.models.presets``; its ``image_size`` is used.
        model_name_or_path: A checkpoint (local folder or hub id); its ``vision_config.image_size`` is used.
        cache_dir: Where downloaded configs are cached.
        revision: Checkpoint branch, tag or commit.
        token: Hub token.

    Returns:
        The short side in pixels.

    Raises:
        ValueError: when none or several of the three are given, the preset is unknown, the checkpoint's config
            cannot be loaded or has no image size, or the size is not positive.
    """
    given = [
        flag
        for flag, value in (
            ("--short_side", short_side),
            ("--model_preset", model_preset),
            ("--model_name_or_path", model_name_or_path),
        )
        if value is not None
    ]
    if len(given) != 1:
        found = f"got {' and '.join(given)}" if given else "got none"
        raise ValueError(
            "give exactly one of --short_side (pixels), --model_preset (its image size) or --model_name_or_path "
            f"(its vision_config.image_size) to set the output short side; {found}"
        )
    if model_preset is not None:
        from vlfit.models.presets import get_preset

        size: Any = get_preset(model_preset).image_size
    elif model_name_or_path is not None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_name_or_path, cache_dir=cache_dir, revision=revision, token=token)
        except (OSError, ValueError) as err:
            raise ValueError(f"--model_name_or_path {model_name_or_path!r}: cannot load its config: {err}") from err
        vision = getattr(config, "vision_config", None)
        size = getattr(vision if vision is not None else config, "image_size", None)
        if size is None:
            raise ValueError(
                f"--model_name_or_path {model_name_or_path!r}: its config has no vision_config.image_size; "
                "pass --short_side instead"
            )
        if isinstance(size, (list, tuple)):  # (height, width): the short side must cover both
            size = min(size)
    else:
        size = short_side
    size = int(size)
    if size < 1:
        raise ValueError(f"the output short side must be at least 1 pixel, got {size} (from {given[0]})")
    return size


# --------------------------------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class OutputColumns:
    """Column names and features of one split's output.

    Args:
        image: Image column (an ``Image`` feature holding ``{bytes, path}``).
        caption: Caption column.
        id: Id column: the source's id column, else ``instance_id`` holding the ids the source generated.
        extras: Extra columns copied from the source.
        features: Features of all of these, written into the parquet schema metadata.
    """

    image: str
    caption: str
    id: str
    extras: tuple[str, ...]
    features: datasets.Features


@dataclass(frozen=True)
class _ShardTask:
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


def _temp_path(output_dir: str, file_name: str) -> str:
    # Hidden and not ending in .parquet, so readers of the folder never pick up a partial shard.
    return os.path.join(output_dir, f".{file_name}.{os.getpid()}.tmp")


def _sample_error(policy: ErrorPolicy, split: str, row: int, sample_id: str | None, err: Exception) -> None:
    """Handle a sample that failed to read or decode: ``"raise"`` stops the run naming the sample.

    The one place a skip policy would go (it would return, and the shard would hold fewer rows).
    """
    who = f"sample {sample_id!r}" if sample_id is not None else "a sample"
    raise PrepareError(f"cannot prepare {who} of split {split!r} (row {row}): {err}") from err


def _build_shard(
    task: _ShardTask,
    source: ImageTextSource,
    output_dir: str,
    short_side: int,
    jpeg_quality: int,
    on_error: ErrorPolicy = "raise",
) -> ShardStats:
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
    temp = _temp_path(output_dir, task.file_name)
    try:
        pq.write_table(table, temp, row_group_size=_ROW_GROUP_SIZE)
        os.replace(temp, final)  # atomic: a shard file either is complete or does not exist
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
    stats.output_bytes = os.path.getsize(final)
    return stats


# Per-worker state, set by the pool initializer (inherited without pickling when the pool forks).
_WORKER: dict[str, Any] = {}


def _init_worker(sources: Mapping[str, ImageTextSource], output_dir: str, short_side: int, jpeg_quality: int) -> None:
    torch.set_num_threads(1)  # one process per core already; intra-op threads would only contend
    _WORKER.update(sources=sources, output_dir=output_dir, short_side=short_side, jpeg_quality=jpeg_quality)


def _run_task(task: _ShardTask) -> tuple[_ShardTask, ShardStats]:
    state = _WORKER
    stats = _build_shard(
        task, state["sources"][task.split], state["output_dir"], state["short_side"], state["jpeg_quality"]
    )
    return task, stats


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork shares the opened sources with the workers for free; spawn pickles them (memory-mapped data by path).
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


# ------------------------------------------------------------------------------------------------- manifest


def _infer_feature(value: Any) -> datasets.features.features.FeatureType:
    if value is None:
        return datasets.Value("string")
    return datasets.Features.from_arrow_schema(pa.schema([pa.field("x", pa.array([value]).type)]))["x"]


def output_columns(
    split: str,
    source: ImageTextSource,
    *,
    image_column: str,
    caption_column: str,
    id_column: str | None = None,
    extra_columns: Sequence[str] = DEFAULT_EXTRA_COLUMNS,
) -> OutputColumns:
    """Decide the output columns of a split so that it reads back exactly as the source did.

    The id column keeps the source's name (``id_column``, else ``instance_id`` or ``id`` when the source has
    one); ids the source generated (row-based ids, tar keys) are written to ``instance_id``. Extra column
    features come from the source's features when it has them, else from the first record's values.

    Args:
        split: Split name (for error messages).
        source: The split's source, opened with the same column arguments.
        image_column: Source image column; the output uses the same name.
        caption_column: Source caption column; the output uses the same name.
        id_column: Source id column, as given to ``open_splits``.
        extra_columns: Extra columns to copy when the source has them.

    Returns:
        The output columns and features.
    """
    if isinstance(source, ArrowSource):
        # The same rule ArrowSource applies when picking its id column.
        id_name = id_column or next((c for c in ("instance_id", "id") if c in source.column_names), "instance_id")
        known = source.dataset.features
        extras = tuple(c for c in extra_columns if c in source.column_names)
        extra_features = {c: known[c] for c in extras}
    else:
        id_name = id_column or "instance_id"
        first = source[0].extra if len(source) else {}
        extras = tuple(c for c in extra_columns if c in first)
        extra_features = {c: _infer_feature(first[c]) for c in extras}
    names = [image_column, caption_column, id_name, *extras]
    if len(set(names)) != len(names):
        raise ValueError(f"split {split!r}: output columns {names} are not distinct; check the column arguments")
    features = datasets.Features(
        {
            image_column: datasets.Image(),
            caption_column: datasets.Value("string"),
            id_name: datasets.Value("string"),
            **extra_features,
        }
    )
    return OutputColumns(image_column, caption_column, id_name, extras, features)


def _read_manifest(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as err:
        raise ManifestMismatchError(f"{path} is not valid JSON ({err}); pick a new --output_dir") from err
    if not isinstance(manifest, dict) or manifest.get("format_version") != MANIFEST_VERSION:
        raise ManifestMismatchError(f"{path} was written by another version of vlfit prepare; pick a new --output_dir")
    return manifest


def _write_manifest(path: str, manifest: Mapping[str, Any]) -> None:
    temp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(temp, path)


def _differences(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = list(dict.fromkeys([*old, *new]))
        return [d for k in keys for d in _differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else k)]
    return [] if old == new else [f"{prefix}: was {old!r}, now {new!r}"]


def _check_compatible(output_dir: str, manifest: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    changed = _differences(manifest.get("settings", {}), dict(settings), "")
    if changed:
        raise ManifestMismatchError(
            f"{output_dir} was prepared with other settings ({'; '.join(changed)}). Resuming would mix "
            "incompatible shards: pick a new --output_dir (or delete this one)."
        )


def _check_empty(output_dir: str) -> None:
    foreign = [name for name in os.listdir(output_dir) if not _TEMP_FILE.match(name)]
    if foreign:
        listed = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise ManifestMismatchError(
            f"{output_dir} is not empty ({listed}) and holds no {MANIFEST_NAME}, so it was not written by "
            "vlfit prepare; pick a new --output_dir"
        )


def _remove_temp_files(output_dir: str) -> None:
    for name in os.listdir(output_dir):
        if _TEMP_FILE.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(output_dir, name))


def _parquet_rows(path: str) -> int | None:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowInvalid):
        return None


# ------------------------------------------------------------------------------------------------- datasets


@dataclass
class PrepareSummary:
    """What a ``prepare_dataset`` run did, over every shard of the requested splits (built now or before).

    Args:
        output_dir: The output folder.
        short_side: Output short side in pixels.
        jpeg_quality: Output JPEG quality.
        split_rows: Samples per split.
        totals: Counts over all shards of the requested splits.
        shards_total: Shards of the requested splits.
        shards_built: Shards written by this run.
        samples_built: Samples written by this run.
        elapsed_s: Wall time of this run in seconds.
    """

    output_dir: str
    short_side: int
    jpeg_quality: int
    split_rows: dict[str, int]
    totals: ShardStats
    shards_total: int
    shards_built: int
    samples_built: int
    elapsed_s: float
    built_shards: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        """Samples over all requested splits."""
        return self.totals.rows

    @property
    def byte_ratio(self) -> float:
        """Source image bytes / output file bytes."""
        return self.totals.input_bytes / max(self.totals.output_bytes, 1)

    @property
    def images_per_s(self) -> float:
        """Samples written by this run per second of its wall time."""
        return self.samples_built / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def pixel_reduction(self) -> float:
        """Pixels the fast pipeline decodes from the source (DCT-scaled) / pixels it decodes from the output."""
        return self.totals.decoded_pixels / max(self.totals.output_pixels, 1)

    @property
    def full_size_pixel_reduction(self) -> float:
        """Full-size source pixels / output pixels."""
        return self.totals.source_pixels / max(self.totals.output_pixels, 1)


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
    source_description: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> PrepareSummary:
    """Re-encode every split at ``short_side`` into parquet shards under ``output_dir``, resuming earlier runs.

    Shards whose file exists with the expected row count (and whose counts the manifest holds) are kept; the rest
    are built, in ``num_proc`` processes. The manifest is rewritten after every shard. An empty split gets no
    shard (so it does not appear when the folder is read back).

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
        source_description: Where the data came from (flags, paths); compared on resumption. Defaults to the
            sources' names.
        progress: Show a progress bar over samples.

    Returns:
        The counts of the run.

    Raises:
        ValueError: for a setting out of range.
        ManifestMismatchError: when ``output_dir`` holds other data or an earlier run with other settings, or a
            split's row count changed since.
        PrepareError: naming the split and sample when an image cannot be read or decoded.
    """
    for name, value, low in (("short_side", short_side, 1), ("shard_size", shard_size, 1), ("num_proc", num_proc, 1)):
        if value < low:
            raise ValueError(f"--{name} must be at least {low}, got {value}")
    if not 1 <= jpeg_quality <= 100:
        raise ValueError(f"--jpeg_quality must be in 1..100, got {jpeg_quality}")
    if not sources:
        raise ValueError("no splits to prepare")
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

    os.makedirs(output_dir, exist_ok=True)
    manifest_path = os.path.join(output_dir, MANIFEST_NAME)
    manifest = _read_manifest(manifest_path)
    if manifest is None:
        _check_empty(output_dir)
        manifest = {"format_version": MANIFEST_VERSION, "settings": settings, "splits": {}}
    else:
        _check_compatible(output_dir, manifest, settings)
    manifest["encoder"] = JPEG_ENCODER

    tasks: list[_ShardTask] = []
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
        )
        names = [shard_file_name(split, i, num_shards) for i in range(num_shards)]
        kept = (earlier or {}).get("shards", {})
        manifest["splits"][split] = {
            "rows": rows,
            "num_shards": num_shards,
            "source_name": source.name,
            "columns": {"image": columns.image, "caption": columns.caption, "id": columns.id},
            "extra_columns": list(columns.extras),
            "shards": {n: kept[n] for n in names if n in kept},
        }
        for i, file_name in enumerate(names):
            start, stop = i * shard_size, min((i + 1) * shard_size, rows)
            tasks.append(_ShardTask(split, i, num_shards, start, stop, file_name, columns))
    _remove_temp_files(output_dir)

    def done(task: _ShardTask) -> bool:
        entry = manifest["splits"][task.split]["shards"].get(task.file_name)
        path = os.path.join(output_dir, task.file_name)
        return entry is not None and _parquet_rows(path) == task.stop - task.start == entry.get("rows")

    todo = [task for task in tasks if not done(task)]
    for task in todo:
        manifest["splits"][task.split]["shards"].pop(task.file_name, None)
    manifest["complete"] = not todo
    _write_manifest(manifest_path, manifest)

    built: list[str] = []
    bar = tqdm(total=sum(t.stop - t.start for t in todo), unit="img", desc="prepare", disable=not progress or not todo)

    def record(task: _ShardTask, stats: ShardStats) -> None:
        shards = manifest["splits"][task.split]["shards"]
        shards[task.file_name] = asdict(stats)
        manifest["splits"][task.split]["shards"] = dict(sorted(shards.items()))  # workers finish in any order
        built.append(task.file_name)
        manifest["complete"] = len(built) == len(todo)
        _write_manifest(manifest_path, manifest)
        bar.update(stats.rows)

    try:
        workers = min(num_proc, len(todo))
        if workers <= 1:
            with torch_threads(1):
                for task in todo:
                    record(task, _build_shard(task, sources[task.split], output_dir, short_side, jpeg_quality))
        else:
            init_args = (dict(sources), output_dir, short_side, jpeg_quality)
            with _pool_context().Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
                for task, stats in pool.imap_unordered(_run_task, todo):
                    record(task, stats)
    finally:
        bar.close()
        _remove_temp_files(output_dir)  # a failed run's workers may leave partial files behind

    totals = ShardStats()
    for split in sources:
        for entry in manifest["splits"][split]["shards"].values():
            totals.add(ShardStats(**entry))
    return PrepareSummary(
        output_dir=output_dir,
        short_side=short_side,
        jpeg_quality=jpeg_quality,
        split_rows={split: len(source) for split, source in sources.items()},
        totals=totals,
        shards_total=len(tasks),
        shards_built=len(built),
        samples_built=sum(t.stop - t.start for t in todo),
        elapsed_s=time.perf_counter() - started,
        built_shards=sorted(built),
    )


def format_report(summary: PrepareSummary) -> str:
    """A human-readable report of a run: sizes, speed and the decoded-pixel reduction.

    Args:
        summary: What ``prepare_dataset`` returned.

    Returns:
        Several lines of text.
    """
    t = summary.totals
    splits = ", ".join(f"{split} {rows}" for split, rows in summary.split_rows.items())
    kept = summary.shards_total - summary.shards_built
    mb = 1e6
    ratio = summary.byte_ratio
    size_change = f"{ratio:.1f}x smaller" if ratio >= 1 else f"{1 / max(ratio, 1e-9):.1f}x larger"
    return "\n".join(
        [
            f"prepared {summary.samples} samples ({splits}) into {summary.output_dir}",
            f"  shards: {summary.shards_total} ({summary.shards_built} built now, {kept} kept from an earlier run)",
            f"  short side {summary.short_side} px, JPEG quality {summary.jpeg_quality} ({CHROMA_SUBSAMPLING}); "
            f"{t.small_images} images already at or below it kept their size (not upscaled)",
            f"  bytes: input {t.input_bytes / mb:.2f} MB (source images) -> output {t.output_bytes / mb:.2f} MB "
            f"(parquet files), ratio {summary.byte_ratio:.2f} ({size_change})",
            f"  time: {summary.elapsed_s:.1f} s for {summary.samples_built} samples built now, "
            f"{summary.images_per_s:.1f} images/s",
            f"  decoded pixels per epoch: {t.decoded_pixels / mb:.2f} M from the source with DCT scaling (what the "
            f"fast pipeline decodes) -> {t.output_pixels / mb:.2f} M from the output, "
            f"{summary.pixel_reduction:.1f}x fewer ({t.source_pixels / mb:.2f} M at full source size, "
            f"{summary.full_size_pixel_reduction:.1f}x)",
        ]
    )
