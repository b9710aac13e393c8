"""How a multi-process run shares out its data: logged once the data is known, with early errors."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

from vlfit.errors import ConfigError

logger = logging.getLogger(__name__)


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
        raise ConfigError(
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
