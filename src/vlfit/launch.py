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
- Processes started by SLURM's ``srun`` (one per device, no torchrun: open_clip's recipes) carry SLURM's variables,
  not torch's: ``adopt_slurm_environment`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` (the job's first node) and ``MASTER_PORT`` (given, else one derived from the job id, the same in
  every task) from them, where torch's are not set already (``srun torchrun ...`` sets its own).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

from vlfit.errors import ConfigError, first_line

CPU_BACKENDS = ("gloo", "mpi")
# Without MASTER_PORT, SLURM tasks meet on this port plus the job id's last four digits (as Lightning does): the
# same in every task of a job, and rarely the same for two jobs sharing a node.
SLURM_BASE_PORT = 15000


def adopt_slurm_environment(environ: dict[str, str] | None = None) -> bool:
    """Set torch's launch variables from SLURM's in ``environ`` (``os.environ``) when this process is one of several
    tasks of an ``srun`` step (``SLURM_STEP_ID`` set: a batch script's own process has SLURM's job variables too,
    and is no task of a step) and torch's are not set; whether it did.

    ``RANK`` <- ``SLURM_PROCID``, ``WORLD_SIZE`` <- ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), ``LOCAL_RANK``
    <- ``SLURM_LOCALID``, ``LOCAL_WORLD_SIZE`` <- the tasks on this node (``SLURM_STEP_TASKS_PER_NODE``'s or
    ``SLURM_TASKS_PER_NODE``'s first count), ``MASTER_ADDR`` <- the step's first host (``first_host``),
    ``MASTER_PORT`` <- ``SLURM_BASE_PORT`` plus the job id's last four digits, each only where it is not set.
    """
    env = os.environ if environ is None else environ
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    srun_task = "SLURM_STEP_ID" in env and "SLURM_PROCID" in env
    if "RANK" in env or "WORLD_SIZE" in env or not srun_task or int(world) <= 1:
        return False
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    job = re.sub(r"\D", "", env.get("SLURM_JOB_ID", "")) or "0"
    values = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": re.split(r"[(,]", per_node)[0],
        "MASTER_ADDR": first_host(nodes) or "127.0.0.1",
        "MASTER_PORT": str(SLURM_BASE_PORT + int(job[-4:])),
    }
    for name, value in values.items():
        env.setdefault(name, value)
    return True


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (``node[01-04,07],gpu5`` -> ``node01``; what ``scontrol show hostnames``
    prints first), or ``""`` for an empty one."""
    found = re.match(r"\s*([^,\[]*)(?:\[([^\]]*)\])?", nodelist)
    if not found or not found.group(1) and not found.group(2):
        return ""
    prefix, ranges = found.group(1), found.group(2)
    return prefix + re.split(r"[-,]", ranges)[0] if ranges else prefix


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
    adopt_slurm_environment()  # srun's tasks: torch's variables from SLURM's, for transformers and accelerate too
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
    adopt_slurm_environment()
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
