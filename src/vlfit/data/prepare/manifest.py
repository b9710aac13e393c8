"""The manifest of a prepared folder (``vlfit_prepare.json``): reading, writing, and checks before resuming.

The manifest holds the settings of the run, and per split its row count, columns and the counts of every shard
written so far. A re-run compares settings with it, and keeps a shard only when the manifest holds its counts and
its file has the expected rows.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vlfit.atomic_files import TEMP_FILE_PATTERN, write_text_atomically

MANIFEST_NAME = "vlfit_prepare.json"
MANIFEST_VERSION = 1


class ManifestMismatchError(ValueError):
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


def parquet_rows(path: str) -> int | None:
    """The row count of a parquet file; None when it is missing or unreadable."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowInvalid):
        return None
