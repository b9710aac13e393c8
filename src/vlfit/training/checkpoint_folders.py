"""Checkpoint folders that appear whole or not at all.

A checkpoint is written into ``<output_dir>/.partial-checkpoint-N/checkpoint-N`` and renamed into place once
complete: the staging name matches neither ``get_last_checkpoint``'s ``^checkpoint-\\d+$`` nor the
``checkpoint-*`` glob of checkpoint rotation, so a kill during saving never leaves a folder that resuming would take
for a complete checkpoint.
"""

from __future__ import annotations

import os
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from vlfit.atomic_files import fsync_file, fsync_folder
from vlfit.errors import WriteFailedError, failed_write_error

STAGING_PREFIX = ".partial-"


def publish_staged_checkpoint(staged_dir: str, final_dir: str) -> None:
    """Flush ``staged_dir`` to disk and rename it to ``final_dir`` (atomic on one filesystem), replacing a
    checkpoint of the same step saved before; then remove the staging folder around it."""
    staging_root = os.path.dirname(staged_dir)
    run_dir = os.path.dirname(final_dir)
    _fsync_tree(staged_dir)
    if os.path.isdir(final_dir):
        # The same step saved twice (a stop requested on a save step): swap, then drop the old copy.
        os.replace(final_dir, os.path.join(staging_root, "previous"))
    os.replace(staged_dir, final_dir)
    fsync_folder(run_dir)
    shutil.rmtree(staging_root, ignore_errors=True)


def remove_partial_checkpoints(run_dir: str) -> list[str]:
    """Delete staging folders left by saves that were killed; returns what was removed."""
    if not os.path.isdir(run_dir):
        return []
    removed = []
    for entry in os.listdir(run_dir):
        if entry.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
            shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
            removed.append(entry)
    return removed


def _fsync_tree(folder: str) -> None:
    """Flush every file of ``folder`` to disk, so the rename never publishes data still in the page cache."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_folder(root)


def failed_checkpoint_write(error: BaseException, run_dir: str, staging_root: str) -> WriteFailedError | None:
    """``error``, raised while a checkpoint was staged in ``staging_root``, as one line when it is a write that
    failed (``vlfit.errors.failed_write_error``: the disk full, or torch's zip writer failing without an errno);
    None for any other error. The line names the folder, its free space as the write failed, about what a checkpoint
    takes (the last one's size, or what was written before the failure) and the last complete checkpoint, from
    which a rerun resumes; the partial copy then goes (its space is given back)."""
    partial = _folder_size(staging_root)
    last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    needed = (_folder_size(last) if last else 0) or partial or None
    note = f"the last complete checkpoint is {last}" if last else "no complete checkpoint was saved yet"
    failure = failed_write_error(error, run_dir, needed=needed, note=note)
    if failure is not None:
        shutil.rmtree(staging_root, ignore_errors=True)
    return failure


def _folder_size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)
