"""The manifest of a prepared folder (``vlfit_prepare.json``): reading, writing, and checks before resuming.

The manifest holds the settings of the run, and per split its row count, columns, bad-sample count and, for every
shard written so far, its counts and the bad samples left out of it. A re-run compares settings with it, and keeps
a shard only when the manifest holds its entry and its file has the recorded rows; the bad samples of kept shards
come from their entries, so an interrupted and resumed run reports what an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vlfit.atomic_files import TEMP_FILE_PATTERN, write_text_atomically
from vlfit.data.prepare.shards import ShardStats, SkippedSample
from vlfit.errors import DataError

MANIFEST_NAME = "vlfit_prepare.json"
MANIFEST_VERSION = 1


class ManifestMismatchError(DataError):
    """The output folder was prepared with other settings or from another source."""


def read_manifest(path: str) -> dict[str, Any] | None:
    """Read a manifest; None when there is none.

    Raises:
        ManifestMismatchError: when the file is not valid JSON or was written by another format version.
    """
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


def write_manifest(path: str, manifest: Mapping[str, Any]) -> None:
    """Write a manifest, replacing the old one atomically (an interrupted write leaves the old one)."""
    write_text_atomically(path, json.dumps(manifest, indent=1, sort_keys=False) + "\n")


def _differences(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = list(dict.fromkeys([*old, *new]))
        return [d for k in keys for d in _differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else k)]
    return [] if old == new else [f"{prefix}: was {old!r}, now {new!r}"]


def check_compatible(output_dir: str, manifest: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Refuse to resume a folder prepared with other settings.

    Raises:
        ManifestMismatchError: listing every setting that changed.
    """
    changed = _differences(manifest.get("settings", {}), dict(settings), "")
    if changed:
        raise ManifestMismatchError(
            f"{output_dir} was prepared with other settings ({'; '.join(changed)}). Resuming would mix "
            "incompatible shards: pick a new --output_dir (or delete this one)."
        )


def check_empty(output_dir: str) -> None:
    """Refuse to write into a folder without a manifest that holds anything besides temporary files.

    Raises:
        ManifestMismatchError: naming a few of the files found.
    """
    foreign = [name for name in os.listdir(output_dir) if not TEMP_FILE_PATTERN.match(name)]
    if foreign:
        listed = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise ManifestMismatchError(
            f"{output_dir} is not empty ({listed}) and holds no {MANIFEST_NAME}, so it was not written by "
            "vlfit prepare; pick a new --output_dir"
        )


def remove_temp_files(output_dir: str) -> None:
    """Remove the temporary files an interrupted or failed run left in ``output_dir``.

    Every ``atomic_files`` temporary file goes, whatever its target: the folder belongs to ``vlfit prepare``
    (``check_empty``), so each is the leftover of a shard, manifest or report write that did not finish.
    """
    for name in os.listdir(output_dir):
        if TEMP_FILE_PATTERN.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(output_dir, name))


def shard_entry(stats: ShardStats, skipped: Sequence[SkippedSample]) -> dict[str, Any]:
    """A shard's manifest entry: its counts and the ``{id, reason}`` of every bad sample left out of it."""
    return {**asdict(stats), "bad_samples": [{"id": s.id, "reason": s.reason} for s in skipped]}


def entry_skipped(split: str, entry: Mapping[str, Any]) -> list[SkippedSample]:
    """The bad samples a shard entry of ``split`` records, in row order."""
    return [SkippedSample(split, str(bad["id"]), str(bad["reason"])) for bad in entry.get("bad_samples", [])]


def skipped_samples(manifest: Mapping[str, Any], splits: Sequence[str] | None = None) -> Iterator[SkippedSample]:
    """Every bad sample the manifest records, split by split (``splits``, default all), shard by shard."""
    for split, info in manifest["splits"].items():
        if splits is None or split in splits:
            for name in sorted(info["shards"]):
                yield from entry_skipped(split, info["shards"][name])


def shard_is_complete(path: str, entry: Mapping[str, Any] | None, num_samples: int) -> bool:
    """Whether a shard can be kept from an earlier run.

    Args:
        path: The shard file.
        entry: Its manifest entry, None when the manifest has none.
        num_samples: Source samples the shard covers.

    Returns:
        True when the entry accounts for every sample (written or left out as bad) and the file holds the rows it
        records (no file when every sample was bad).
    """
    if entry is None:
        return False
    stats = ShardStats.from_entry(entry)
    if stats.rows + stats.skipped != num_samples or len(entry.get("bad_samples", [])) != stats.skipped:
        return False
    if not stats.rows:
        return not os.path.exists(path)
    return _parquet_rows(path) == stats.rows


def _parquet_rows(path: str) -> int | None:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowInvalid):
        return None
