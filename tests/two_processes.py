"""The 2-process gloo checks of several test modules in one spawn: starting a process costs seconds of imports, so
the loss and gradient-cache equalities share two workers instead of starting two each.

Each job is a module's ``two_process_payload()`` (what both processes read; it may take ``folder``, the job's own,
and ``dataset_dir``, the session's synthetic dataset) and its ``two_process_worker(rank, world, init_file,
payload_path, out_dir)``, which forms its own process group, writes ``rank{r}.pt`` into its folder and destroys the
group; the jobs run one after the other in the same two processes.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch
import torch.multiprocessing as mp

MODULES = (
    "tests.models.test_losses",
    "tests.models.test_itm",
    "tests.models.test_dual_encoders",
    "tests.training.test_gradient_cache",
    "tests.index.test_retrieve",
    "tests.training.test_stream_training",
)


def _run_jobs(rank: int, jobs: list[tuple[str, str]]) -> None:
    for module_name, folder in jobs:
        worker = importlib.import_module(module_name).two_process_worker
        worker(rank, 2, str(Path(folder) / "init"), str(Path(folder) / "payload.pt"), folder)


def run_two_processes(root: Path, dataset_dir: str) -> None:
    """Every module's job in one 2-process spawn, each writing its ranks' results into its folder under ``root``."""
    jobs = []
    for module_name in MODULES:
        folder = _job_folder(root, module_name)
        folder.mkdir(parents=True)
        make_payload = importlib.import_module(module_name).two_process_payload
        wanted = inspect.signature(make_payload).parameters
        context = {"folder": folder, "dataset_dir": dataset_dir}
        torch.save(make_payload(**{name: context[name] for name in wanted}), folder / "payload.pt")
        jobs.append((module_name, str(folder)))
    mp.spawn(_run_jobs, args=(jobs,), nprocs=2, join=True)


def read_results(root: Path) -> dict[str, list[dict]]:
    """What ``run_two_processes`` wrote under ``root``: the two ranks' results by module name."""
    return {
        module_name: [torch.load(_job_folder(root, module_name) / f"rank{rank}.pt") for rank in range(2)]
        for module_name in MODULES
    }


def _job_folder(root: Path, module_name: str) -> Path:
    """Where a module's job keeps its payload and its ranks' results under ``root``."""
    return root / module_name.rpartition(".")[2]
