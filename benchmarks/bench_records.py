"""What the benchmark scripts that write a JSON record share: the command that reruns them, the machine they ran
on, and the writing itself."""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from vlfit.efficiency.cpu import cpu_info


def rerun_command(script: str, args: argparse.Namespace, leave_out: tuple[str, ...] = ("results",)) -> str:
    """``python benchmarks/<script> --flag value ...``: every parsed flag but ``leave_out`` and those left at None or
    False (a flag set to True as the bare switch)."""
    flags = [f"--{key}" if value is True else f"--{key} {value}" for key, value in vars(args).items()
             if key not in leave_out and value not in (None, False)]  # fmt: skip
    return " ".join([f"python benchmarks/{script}", *flags])


def machine() -> dict[str, object]:
    """The CPU (its model and matrix features), cores, platform and torch a result came from."""
    return {**cpu_info().record(), "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}


def write_record(record: dict[str, object], path: str) -> None:
    """``record`` as JSON at ``path`` (its folder made), and a line saying so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
