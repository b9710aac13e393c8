"""Session fixtures built once for the whole test run rather than once in each pytest-xdist worker that uses them.

A session fixture is per process: under ``make test``'s two workers, a costly one (a 2-process spawn, an export, a
training run) was built twice when the files that use it went to both workers. ``built_once`` builds the folder in
the first worker that asks for it, under a file lock in the run's own temporary folder; a worker that asks while it
is being built waits for it, then reads it as built. What it holds must be read-only to the tests (each copies what
it changes, as they already do); a build that fails leaves nothing marked built, so the next worker that asks
builds it again and fails with its own error.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary folder, which every worker of this run shares (a worker's own is a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name`` of this run, which ``build(folder)`` filled in whichever worker asked first."""
    root = run_folder(tmp_path_factory)
    folder, built = root / f"once-{name}", root / f"once-{name}.built"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes, a failed build's included
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a failed build's leftovers
            folder.mkdir()
            build(folder)
            built.touch()
    return folder
