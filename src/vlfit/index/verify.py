"""Checking an index folder against its manifest, and opening it only when it is whole.

``verify_index`` runs the checks of ``vlfit.index.integrity`` over every file the manifest names (``quick``: the
manifest parses and each file exists with its recorded size; ``full``: checksums, ids and captions that parse and
hold their rows, finite embeddings) and reports each problem in one line. ``open_index`` is the door of
``vlfit serve``, ``vlfit retrieve query`` and ``vlfit.Index.open``: it opens an index that passes, and raises a
``DamagedIndexError`` naming the first damaged file and the command that rebuilds it otherwise.
``vlfit retrieve verify`` prints the whole report. A build (``vlfit retrieve index`` over an existing index) checks
the shards the same way and embeds the items of damaged ones again (``damaged_shards``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlfit.index.ann import ANN_DESCRIPTION, ANN_FILE
from vlfit.index.integrity import DamagedIndexError, check_verify_level, file_problem
from vlfit.index.manifest import MANIFEST_NAME
from vlfit.index.store import EmbeddingIndex
from vlfit.models.reference import check_index_folder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """A damaged file: which, what is wrong with it, and the command that rebuilds it."""

    file: str
    what: str
    repair: str

    @property
    def line(self) -> str:
        return f"{self.file}: {self.what}; rebuild it: {self.repair}"


@dataclass
class IndexCheck:
    """What ``verify_index`` found.

    Attributes:
        path: The index folder.
        level: ``quick`` or ``full``.
        files: How many files were checked.
        items: The rows the manifest lists (0 when it does not parse).
        problems: One per damaged file.
        notes: What could not be checked (files the manifest records no size or checksum for).
        index: The index as its manifest was read for the check (None when it does not parse): what
            ``open_index`` hands on, so the manifest is read once.
    """

    path: str
    level: str
    files: int = 0
    items: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    index: EmbeddingIndex | None = field(default=None, repr=False)

    @property
    def whole(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as ``vlfit retrieve verify --json`` prints it."""
        problems = [{"file": p.file, "problem": p.what, "rebuild": p.repair} for p in self.problems]
        return {"index": self.path, "verify": self.level, "whole": self.whole, "files": self.files,
                "items": self.items, "problems": problems, "notes": self.notes}  # fmt: skip

    def lines(self) -> list[str]:
        """The report as ``vlfit retrieve verify`` prints it: one line per problem, then the notes, then the
        verdict."""
        verdict = "whole" if self.whole else f"{len(self.problems)} damaged"
        return [
            *(problem.line for problem in self.problems),
            *(f"note: {note}" for note in self.notes),
            f"{self.path}: {verdict} ({self.level} check of {self.files} files, {self.items} items)",
        ]


def _shard_problems(index: EmbeddingIndex, shard: dict[str, Any], level: str) -> tuple[list[tuple[str, str]], int]:
    """``(file, what is wrong)`` of each damaged file of one shard, and how many files have no recorded size."""
    recorded = shard.get("files") or {}
    names = [shard["embeddings"], shard["ids"], *([shard["captions"]] if shard.get("captions") else [])]
    found = []
    unrecorded = 0
    for name in names:
        unrecorded += name not in recorded
        problem = file_problem(os.path.join(index.path, name), recorded.get(name), level)
        if problem:
            found.append((name, problem))
    if found:
        return found, unrecorded
    rows = int(shard["count"])
    if level == "full":  # the contents parse and hold the shard's rows
        for name in names[1:]:
            try:
                index.read_rows(name, rows)
            except DamagedIndexError as err:
                found.append((name, err.problem))
    if level == "full" or shard["embeddings"] not in recorded:
        # Mapping the shard reads its header only: a file without a recorded size is checked to hold its rows.
        try:
            array = index.vectors().shard(index.manifest.shards.index(shard))
        except DamagedIndexError as err:
            found.append((shard["embeddings"], err.problem))
            return found, unrecorded
        if level == "full":
            bad = int((~np.isfinite(array).all(axis=1)).sum())
            if bad:
                found.append((shard["embeddings"], f"{bad} of {rows} embeddings hold NaN or infinite values"))
    return found, unrecorded


def shard_problems(index: EmbeddingIndex, position: int, level: str = "quick") -> list[Problem]:
    """The problems of the shard at ``position`` in the manifest of ``index`` (none when it is whole)."""
    shard = index.manifest.shards[position]
    found, _ = _shard_problems(index, shard, level)
    repair = index.rebuild_command(full=level == "full", shard=shard)
    return [Problem(os.path.join(index.path, name), what, repair) for name, what in found]


def damaged_shards(index: EmbeddingIndex, level: str = "quick") -> dict[int, list[tuple[str, str]]]:
    """The shards of ``index`` (by position in its manifest) with a damaged file, and their problems: each the
    file's path and what is wrong with it (a build over the index is what repairs them: no command is named)."""
    check_verify_level(level)
    damaged: dict[int, list[tuple[str, str]]] = {}
    for position, shard in enumerate(index.manifest.shards):
        found, _ = _shard_problems(index, shard, level)
        if found:
            damaged[position] = [(os.path.join(index.path, name), what) for name, what in found]
    return damaged


def verify_index(path: str, level: str = "quick") -> IndexCheck:
    """Check the index at ``path`` against its manifest (``quick`` or ``full``, as the module says).

    Raises:
        MissingFileError: when the folder holds no index.
        ConfigError: for another level.
    """
    check_verify_level(level)
    check_index_folder(path)
    check = IndexCheck(path, level)
    try:
        index = EmbeddingIndex(path)
    except DamagedIndexError as err:
        check.files = 1
        check.problems.append(Problem(err.file, err.problem, err.repair))
        return check
    manifest = index.manifest
    check.index, check.files, check.items = index, 1, manifest.count
    repair = index.rebuild_command(full=level == "full")
    unrecorded = 0
    for shard in manifest.shards:
        found, missing_records = _shard_problems(index, shard, level)
        check.files += 2 + bool(shard.get("captions"))
        unrecorded += missing_records
        if found:  # repaired by the build of its own collection
            shard_repair = index.rebuild_command(full=level == "full", shard=shard)
            check.problems += [Problem(os.path.join(path, name), what, shard_repair) for name, what in found]
    if manifest.ann:
        check.files += 2
        ann_path = os.path.join(path, ANN_FILE)
        problem = file_problem(ann_path, manifest.ann if "bytes" in manifest.ann else None, level)
        if problem:
            check.problems.append(Problem(ann_path, problem, repair))
        elif "bytes" not in manifest.ann:
            unrecorded += 1
        described = os.path.join(path, ANN_DESCRIPTION)
        if not os.path.isfile(described):
            check.problems.append(Problem(described, "missing", repair))
    if unrecorded:
        checked = "that they exist and hold their rows" + (", parse and are finite" if level == "full" else "")
        check.notes.append(
            f"{unrecorded} of {check.files - 1} files have no size or checksum in the manifest (an index written "
            f"before vlfit recorded them): checked only {checked}; an index built again records them"
        )
    return check


def manifest_stamp(path: str) -> tuple[int, int] | None:
    """``(mtime_ns, size)`` of the manifest of the index at ``path``; None when there is none."""
    try:
        stat = os.stat(os.path.join(path, MANIFEST_NAME))
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def recorded_files(index: EmbeddingIndex) -> dict[str, dict[str, object] | None]:
    """Every file the manifest of ``index`` names (shards' embeddings, ids and captions; the ANN structure), with
    what it records of each (``{"bytes", "sha256"}``; None for an index written before it recorded them)."""
    files: dict[str, dict[str, object] | None] = {}
    for shard in index.manifest.shards:
        recorded = shard.get("files") or {}
        for name in (shard["embeddings"], shard["ids"], shard.get("captions")):
            if name:
                files[os.path.join(index.path, name)] = recorded.get(name)
    ann = index.manifest.ann
    if ann:
        files[os.path.join(index.path, ANN_FILE)] = ann if "bytes" in ann else None
    return files


def verified_stamp(path: str, verify: str = "quick") -> tuple[int, int] | None:
    """Check the index at ``path`` as ``open_index`` does at level ``verify`` and return the stamp of the manifest
    it checked (``manifest_stamp``): ``open_index`` given it as ``verified`` opens that manifest without checking it
    again (``vlfit serve``'s parent checks once for all its workers).

    Returns:
        The stamp; None when the manifest changed during the check (the next ``open_index`` checks then).

    Raises:
        MissingFileError: when the folder holds no index.
        DamagedIndexError: naming the first damaged file and the command that rebuilds it.
    """
    stamp = manifest_stamp(path)
    open_index(path, verify)
    return stamp if manifest_stamp(path) == stamp else None


def open_index(path: str, verify: str = "quick", verified: tuple[int, int] | None = None) -> EmbeddingIndex:
    """The index at ``path``, once ``verify_index`` finds it whole at level ``verify``.

    Args:
        path: The index folder.
        verify: ``quick`` or ``full``.
        verified: The stamp ``verified_stamp`` returned: while the manifest still has it, the index opens without
            being checked again (a changed manifest, a rebuilt index, is checked).

    Raises:
        MissingFileError: when the folder holds no index.
        DamagedIndexError: naming the first damaged file (and how many others there are) and the command that
            rebuilds it.
    """
    if verified is None or manifest_stamp(path) != tuple(verified):
        check = verify_index(path, verify)
        if check.problems:
            first, others = check.problems[0], len(check.problems) - 1
            more = f" ({others} more damaged files: vlfit retrieve verify --index {path})" if others else ""
            raise DamagedIndexError(first.file, first.what + more, first.repair)
        for note in check.notes:
            logger.info("%s: %s", path, note)
        assert check.index is not None  # a manifest that does not parse is a problem
        return check.index
    return EmbeddingIndex(path)


__all__ = [
    "IndexCheck",
    "Problem",
    "check_index_folder",
    "damaged_shards",
    "manifest_stamp",
    "open_index",
    "recorded_files",
    "verified_stamp",
    "verify_index",
]
