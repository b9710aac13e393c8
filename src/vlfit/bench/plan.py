"""What a sweep measures: ``SweepPlan``, its configurations in order, and the machine-dependent defaults."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import torch

from vlfit.bench.measure import PRECISIONS
from vlfit.bench.selection import get_pipeline
from vlfit.errors import ConfigError
from vlfit.threads import available_cores
from vlfit.training.itm_objective import CONTRASTIVE, TrainingObjective

MODES: tuple[str, ...] = ("loader", "train")

# (mode, pipeline, workers, prefetch factor): one configuration of a sweep (prefetch is None without workers).
Configuration = tuple[str, str, int, int | None]


def default_workers(cores: int | None = None) -> list[int]:
    """0, 1, 2, then powers of two up to the core count (the study swept 0/1/2)."""
    cores = available_cores() if cores is None else cores
    counts = [0, 1, 2]
    n = 4
    while n <= cores:
        counts.append(n)
        n *= 2
    return [c for c in counts if c <= max(cores, 2)]


def default_pipelines(device: torch.device) -> list[str]:
    """Every pipeline the machine can run (``device`` needs CUDA)."""
    names = ["reference", "fast", "prepared"]
    if device.type == "cuda":
        names.append("device")
    return names


def default_precision(device: torch.device) -> str:
    """bf16 autocast on CUDA devices that support it (the study's setting), fp32 elsewhere."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def compile_unavailable(device: torch.device, backend: str) -> str | None:
    """Why ``torch.compile`` with ``backend`` cannot run on ``device`` here, or None where it can: inductor turns a
    model into C++ on a CPU, which needs the compiler it calls (``$CXX``, else ``g++``); its GPU code and the
    other backends need nothing more."""
    if backend != "inductor" or device.type != "cpu":
        return None
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return (
            f"inductor compiles C++ on a CPU and finds no {compiler!r} here (install g++, or name a compiler in "
            "CXX; --torch_compile_backend aot_eager needs none)"
        )
    return None


@dataclass
class SweepPlan:
    """What to measure, resolved (no defaults left to pick).

    Args:
        pipelines: Names from ``vlfit.bench.selection.PIPELINES``.
        workers: DataLoader worker counts.
        prefetch_factors: DataLoader prefetch factors (for worker counts above 0).
        modes: ``loader`` (data path and device stage only) and/or ``train`` (real optimizer steps).
        batch_size: Samples per batch.
        steps: Timed steps per window.
        warmup_steps: Excluded steps at the start of each window.
        repeats: Windows per configuration (median, min and max are reported).
        precision: ``fp32``, ``bf16`` or ``fp16`` autocast for the model.
        objective: What the training step optimizes, as ``vlfit train --objective`` (one of
            ``vlfit.training.arguments.OBJECTIVES``).
        profile_batches: Batches the per-stage profile times (0: no profile).
        compare_bf16: Also measure the compute ceiling in the other of fp32 and bf16.
        compare_compile: Also measure the compute ceiling with the model under ``torch.compile``.
        torch_compile_backend: The ``torch.compile`` backend ``compare_compile`` uses.
        compare_attention: Also measure the compute ceiling with eager and with fused (sdpa) attention.
        auto: After the sweep, measure the best configuration with ``auto_prefetch_factors`` too.
        auto_prefetch_factors: Prefetch factors ``auto`` tries.
        max_config_seconds: Stop repeating a configuration once it has run this long (None: no limit).
        max_seq_length: Caption truncation length.
        seed: Seed for sampling order and the model's initialization.
    """

    pipelines: list[str]
    workers: list[int]
    prefetch_factors: list[int] = field(default_factory=lambda: [2])
    modes: list[str] = field(default_factory=lambda: ["train"])
    batch_size: int = 48
    steps: int = 10
    warmup_steps: int = 3
    repeats: int = 3
    precision: str = "fp32"
    objective: str = CONTRASTIVE
    profile_batches: int = 2
    compare_bf16: bool = False
    compare_compile: bool = False
    torch_compile_backend: str = "inductor"
    compare_attention: bool = False
    auto: bool = False
    auto_prefetch_factors: list[int] = field(default_factory=lambda: [2, 4])
    max_config_seconds: float | None = None
    max_seq_length: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in self.pipelines:
            get_pipeline(name)
        for mode in self.modes:
            if mode not in MODES:
                raise ConfigError(f"unknown mode {mode!r}; choose from: {', '.join(MODES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose from: {', '.join(PRECISIONS)}")
        TrainingObjective(self.objective)  # refuses an unknown --objective as vlfit train does
        if not self.pipelines or not self.workers or not self.modes:
            raise ConfigError("nothing to measure: give at least one pipeline, worker count and mode")
        if min(self.workers) < 0:
            raise ConfigError(f"worker counts must be >= 0, got {self.workers}")
        if min(self.prefetch_factors + self.auto_prefetch_factors) < 1:
            raise ConfigError("prefetch factors must be >= 1")
        for name, value, low in (
            ("per_device_train_batch_size", self.batch_size, 1),
            ("steps", self.steps, 1),
            ("warmup_steps", self.warmup_steps, 0),
            ("repeats", self.repeats, 1),
            ("profile_batches", self.profile_batches, 0),
        ):
            if value < low:
                raise ConfigError(f"--{name} must be at least {low}, got {value}")

    @property
    def trains(self) -> bool:
        """Whether the sweep needs the model (train mode; the compute ceiling comes with it)."""
        return "train" in self.modes


def configurations(plan: SweepPlan) -> list[Configuration]:
    """``(mode, pipeline, workers, prefetch_factor)`` in sweep order (prefetch is None without workers)."""
    out: list[Configuration] = []
    for mode in plan.modes:
        for pipeline in plan.pipelines:
            for workers in plan.workers:
                for prefetch in plan.prefetch_factors if workers else [None]:
                    out.append((mode, pipeline, workers, prefetch))
    return out
