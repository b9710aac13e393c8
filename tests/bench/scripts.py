"""A benchmark script run in the test's process, as ``python benchmarks/SCRIPT ARGS`` runs it from the repository:
the same ``__main__``, argv, working folder and imports (its folder first on the path), seconds sooner than a
process of its own, which imports torch and transformers again."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_benchmark_script(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/{script}`` with ``argv``; fails the test if it exits with an error. The thread count a script
    sets for itself is given back after it."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{script}", *argv])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(REPO / "benchmarks" / script), run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (None, 0), f"benchmarks/{script} exited with {stop.code}"
    finally:
        torch.set_num_threads(threads)
