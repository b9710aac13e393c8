"""Multi-process launches (torchrun, accelerate launch): CPU defaults, early errors and a description of the run.

``prepare_launch`` runs while the training arguments are built, before transformers sets up devices; it covers
what transformers 5 gets wrong or leaves unbounded on CPU-only machines:

- Under ``torchrun`` without ``--use_cpu``, accelerate finds no GPU and treats each process as a separate
  single-process run: every process trains on the whole data set and all of them write the checkpoint.
  ``--bf16`` is also refused without ``--use_cpu``. On a machine without an accelerator, ``use_cpu`` is set.
- A GPU-only backend (``--ddp_backend nccl``) on CPUs would fail deep inside the launch: it is refused up front.
- On CPU, transformers does not pass ``--ddp_timeout`` to ``init_process_group``, so a rendezvous nobody
  answers waits for torch's default of 30 minutes. The gloo process group is created here, with that timeout,
  and a failure names the address it tried.

``describe_launch`` runs once the data is known, and says how the data is shared out over the processes.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

logger = logging.getLogger("vlfit")

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
        RuntimeError: The process group could not be formed within ``--ddp_timeout`` seconds.
    """
    if not runs_on_cpu(args):
        return  # GPU runs: transformers passes --ddp_backend and --ddp_timeout to init_process_group itself
    backend = args.ddp_backend
    if backend is not None and backend not in CPU_BACKENDS:
        reason = "this machine has no GPU" if not torch.cuda.is_available() else "the run is on CPUs (--use_cpu)"
        raise ValueError(
            f"--ddp_backend {backend} needs GPUs and {reason}: use --ddp_backend gloo, or leave it unset "
            "(gloo on CPUs, nccl on NVIDIA GPUs)"
        )
    args.use_cpu = True
    world = launched_world_size()
    # mpi (accelerate's pick when torch has it) is launched by mpirun and sets itself up.
    if world <= 1 or dist.is_initialized() or backend == "mpi" or (backend is None and dist.is_mpi_available()):
        return
    _init_gloo(world, timeout=args.ddp_timeout)


def _init_gloo(world: int, timeout: int) -> None:
    rank = os.environ.get("RANK", "?")
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        raise ValueError(
            f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set: start the processes with torchrun or "
            "accelerate launch, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE yourself"
        )
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    except (dist.DistError, RuntimeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(
            f"process {rank} of {world} could not form the gloo process group with {address}:{port} within "
            f"--ddp_timeout {timeout} s ({first_line}). Check that every process was started and that "
            f"{address}:{port} is reachable from this machine."
        ) from err


def _mpi_launched() -> bool:
    return any(name in os.environ for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"))


def describe_launch(args: Any, num_train_samples: int | None) -> None:
    """Log how the processes share the data, and refuse a run that would have no full global batch.

    The Trainer hands each process a disjoint share of every epoch (accelerate's batch sampler shard, batches
    dealt round-robin). When the epoch does not fill the last global batch, the missing places are filled with
    samples from the start of the epoch (so a few samples are seen twice), or with ``--dataloader_drop_last``
    the incomplete global batch is dropped (so a few samples are not seen that epoch).

    Args:
        args: The training arguments, after device setup (``world_size``, ``process_index``, ...).
        num_train_samples: Size of the training split, or ``None`` without training.

    Raises:
        ValueError: ``--dataloader_drop_last`` with fewer training samples than one global batch.
    """
    world = args.world_size
    negatives = getattr(args, "contrastive_negatives", "local")
    if world <= 1:
        if parse_flag_from_env("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and not _mpi_launched():
            logger.warning(
                "one process: `accelerate launch --cpu --num_processes N` starts N processes only through mpirun "
                "(--mpirun_hostfile); use `accelerate launch --multi_gpu --num_processes N` (torchrun underneath, "
                "gloo on CPUs) or `torchrun --nproc_per_node N`"
            )
        if negatives == "global":
            logger.info("--contrastive_negatives global with one process: the global batch is the local batch")
        return
    local_batch = args.per_device_train_batch_size
    global_batch = local_batch * world
    logger.info(
        "process %d of %d on %s (backend %s): per-device batch %d, global batch %d, contrastive negatives from the "
        "%s batch",
        args.process_index,
        world,
        args.device,
        dist.get_backend() if dist.is_initialized() else "none",
        local_batch,
        global_batch,
        "global" if negatives == "global" else "per-process",
    )
    if num_train_samples is None:
        return
    if args.dataloader_drop_last and num_train_samples < global_batch:
        raise ValueError(
            f"--dataloader_drop_last with {num_train_samples} training samples and a global batch of {global_batch} "
            f"({world} processes x --per_device_train_batch_size {local_batch}) leaves no batch to train on"
        )
    remainder = num_train_samples % global_batch
    if remainder and args.dataloader_drop_last:
        logger.info(
            "each epoch leaves out %d of %d samples (the incomplete last global batch, a different set each epoch)",
            remainder,
            num_train_samples,
        )
    elif remainder:
        logger.info(
            "each epoch repeats %d samples to fill the last global batch of %d; --dataloader_drop_last trains on "
            "each sample at most once per epoch instead",
            global_batch - remainder,
            global_batch,
        )
