"""Process-group setup for multi-process launches (torchrun, accelerate launch) on CPUs, before devices exist.

``prepare_launch`` runs while the training arguments are built, just before ``TrainingArguments`` sets up devices
(which is where transformers itself joins the process group on GPUs); it covers what transformers 5 gets wrong or
leaves unbounded on CPU-only machines:

- Under ``torchrun`` without ``--use_cpu``, accelerate finds no GPU and treats each process as a separate
  single-process run: every process trains on the whole data set and all of them write the checkpoint.
  ``--bf16`` is also refused without ``--use_cpu``. On a machine without an accelerator, ``use_cpu`` is set.
- A GPU-only backend (``--ddp_backend nccl``) on CPUs would fail deep inside the launch: it is refused up front.
- On CPU, transformers does not pass ``--ddp_timeout`` to ``init_process_group``, so a rendezvous nobody
  answers waits for torch's default of 30 minutes. The gloo process group is created here, with that timeout,
  and a failure names the address it tried.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

from vlfit.errors import ConfigError, first_line

CPU_BACKENDS = ("gloo", "mpi")


def launched_world_size() -> int:
    """Number of processes the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def runs_on_cpu(args: Any) -> bool:
    """Whether training will run on CPUs: ``--use_cpu``, ``accelerate launch --cpu``, or no accelerator at all."""
    return bool(args.use_cpu) or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.accelerator.is_available()


def prepare_launch(args: Any) -> None:
    """Settle the device and, on CPU, the process group, before ``TrainingArguments`` sets up devices.

    Args:
        args: The training arguments, before ``TrainingArguments.__post_init__`` (reads ``use_cpu``,
            ``ddp_backend``, ``ddp_timeout``; may set ``use_cpu``).

    Raises:
        ValueError: A backend that needs GPUs on a CPU run, or a multi-process launch without a rendezvous address.
        ConfigError: The process group could not be formed within ``--ddp_timeout`` seconds (a launch that
            did not start every process, or an address this machine cannot reach).
    """
    if not runs_on_cpu(args):
        return  # GPU runs: transformers passes --ddp_backend and --ddp_timeout to init_process_group itself
    backend = args.ddp_backend
    if backend is not None and backend not in CPU_BACKENDS:
        reason = "this machine has no GPU" if not torch.cuda.is_available() else "the run is on CPUs (--use_cpu)"
        raise ConfigError(
            f"--ddp_backend {backend} needs GPUs and {reason}: use --ddp_backend gloo, or leave it unset "
            "(gloo on CPUs, nccl on NVIDIA GPUs)"
        )
    args.use_cpu = True
    world = launched_world_size()
    # mpi (accelerate's pick when torch has it) is launched by mpirun and sets itself up.
    if world <= 1 or dist.is_initialized() or backend == "mpi" or (backend is None and dist.is_mpi_available()):
        return
    _init_gloo(world, timeout=args.ddp_timeout)


def join_gloo_group(timeout: int) -> tuple[int, int]:
    """``(rank, world size)`` of this process: in the process group already formed, or in a gloo group formed
    within ``timeout`` seconds when a launcher started several (``vlfit retrieve index`` under torchrun: CPU
    processes exchanging small objects).

    Raises:
        ConfigError: as ``prepare_launch``, when the group cannot be formed.
    """
    if dist.is_initialized():  # a group the caller formed: its ranks are the build's
        return dist.get_rank(), dist.get_world_size()
    world = launched_world_size()
    if world <= 1:
        return 0, 1
    _init_gloo(world, timeout)
    return dist.get_rank(), dist.get_world_size()


def _init_gloo(world: int, timeout: int) -> None:
    rank = os.environ.get("RANK", "?")
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        raise ConfigError(
            f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set: start the processes with torchrun or "
            "accelerate launch, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE yourself"
        )
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    except (dist.DistError, RuntimeError) as err:
        raise ConfigError(
            f"process {rank} of {world} could not form the gloo process group with {address}:{port} within "
            f"--ddp_timeout {timeout} s ({first_line(err)}). Check that every process was started and that "
            f"{address}:{port} is reachable from this machine."
        ) from err
