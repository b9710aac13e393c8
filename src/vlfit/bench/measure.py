"""Measurement loops: timed windows over a loader, the compute ceiling, peak memory, and stage-timing helpers.

A window runs ``warmup`` steps (excluded, like optimum-habana's ``throughput_warmup_steps``), then *settles*:
up to ``num_workers * prefetch_factor + 1`` more excluded steps that end at the first step that had to wait for
data. Warm-up steps are slow (worker start, first kernels) and let the workers fill the prefetch queue; timing
from a full queue would credit the data path with batches made during warm-up. A step that waits means the queue
is empty, which is the steady state of a data-bound run; a compute-bound run never waits and its queue stays full
at both ends of the window, which is its steady state. Then ``steps`` steps are timed.

Time blocked in ``next()`` is data wait, exactly as ``VlfitTrainer`` counts it: both take batches through the input
pipeline's ``DeviceFeed``, whose ``last_wait`` on CUDA includes launching the next batch's device stage on the side
stream, and on CPU does not.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from vlfit.data.batch import Batch
from vlfit.data.pipeline import DeviceFeed
from vlfit.models.family import LOCAL_LOSS, ModelFamily
from vlfit.training.itm_objective import CONTRASTIVE, TrainingObjective
from vlfit.training.throughput import ThroughputMeter

# A settle step that spends more than this share of its time waiting for data found the prefetch queue empty.
STARVED_WAIT_SHARE = 0.2

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Window:
    """One timed window.

    Args:
        samples_per_second: Samples served (and trained on, in train mode) per second of wall time.
        data_wait_share: Share of the window spent blocked waiting for the next batch, in [0, 1].
        seconds: Length of the window.
        steps: Timed steps.
        settle_steps: Excluded steps after warm-up (see the module docstring).
    """

    samples_per_second: float
    data_wait_share: float
    seconds: float
    steps: int
    settle_steps: int = 0


def summarize(windows: list[Window]) -> dict[str, Any]:
    """Median, min and max samples/s and the median data-wait share of repeated windows."""
    rates = [w.samples_per_second for w in windows]
    return {
        "samples_per_second": statistics.median(rates),
        "samples_per_second_min": min(rates),
        "samples_per_second_max": max(rates),
        "data_wait_share": statistics.median(w.data_wait_share for w in windows),
        "repeats": [round(rate, 3) for rate in rates],
        "settle_steps": [w.settle_steps for w in windows],
    }


# ---------------------------------------------------------------------------------------------------- memory


def host_rss_bytes(pid: int | None = None) -> int:
    """RSS of a process plus all its descendants (the DataLoader workers).

    Pages shared between the main process and forked workers count once per process, so the sum overstates what
    the processes hold together. A process that exits while it is read counts as nothing.
    """
    process = psutil.Process(os.getpid() if pid is None else pid)
    total = 0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += member.memory_info().rss
    return total


class PeakHostMemory:
    """Samples ``host_rss_bytes`` in a background thread; ``peak_bytes`` is the largest reading.

    Args:
        interval_s: Seconds between readings.
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlfit-bench-rss", daemon=True)

    def _read(self) -> None:
        self.peak_bytes = max(self.peak_bytes or 0, host_rss_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()

    def __enter__(self) -> PeakHostMemory:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()


def reset_device_peak(device: torch.device) -> None:
    """Start a new peak-memory reading on CUDA (nothing to do elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last reset; None off CUDA."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------- train step


class TrainStep:
    """One optimizer step of fine-tuning, as ``VlfitTrainer`` runs it.

    The objective's loss under autocast (bf16 or fp16 when asked; the weights stay fp32, as with ``--bf16``),
    backward, gradient clipping at 1.0 (the Trainer's ``max_grad_norm``) and AdamW. The loss is the family's
    contrastive loss, or with an image-text matching objective ``TrainingObjective.loss`` (the fused passes on the
    pairs and on hard negatives), with each call its own step number so that negatives are drawn as in training.

    Args:
        model: The model, on ``device``, prepared for ``objective`` (``prepare_model_for_objective``).
        family: Its model family (the contrastive loss).
        device: Where the model is.
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast dtype).
        learning_rate: AdamW learning rate (the study's 1e-5).
        objective: What the step optimizes (``vlfit train --objective``).
        seed: With the step number, seeds the draw of negatives (as ``--seed`` does in training).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        family: ModelFamily,
        device: torch.device,
        precision: str,
        learning_rate: float = 1e-5,
        *,
        objective: str = CONTRASTIVE,
        seed: int = 0,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose from: {', '.join(PRECISIONS)}")
        self.model = model
        self.family = family
        self.device = device
        self.precision = precision
        self.objective = TrainingObjective(objective, seed)
        self.steps_taken = 0
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        # The Trainer's default optimizer (adamw_torch_fused): fused AdamW, on CUDA and on CPUs alike.
        self.optimizer = torch.optim.AdamW(self.parameters, lr=learning_rate, fused=True)
        self.model.train()

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the device stage hands the model (its weights' dtype; autocast casts inside)."""
        return next(self.model.parameters()).dtype

    def autocast(self, precision: str | None = None) -> contextlib.AbstractContextManager:
        """Autocast for ``precision`` (default: this step's), or a no-op for fp32."""
        dtype = PRECISIONS[precision or self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def loss(self, batch: Batch) -> torch.Tensor:
        """The objective's loss of ``batch``, as ``VlfitTrainer.compute_loss`` computes it for one process (local
        negatives, the model's own contrastive loss: the bench has no flags for the other choices)."""
        if self.objective.uses_itm:
            return self.objective.loss(self.family, self.model, batch.inputs, step=self.steps_taken, scope=LOCAL_LOSS)
        return self.family.contrastive_loss(self.model, batch.inputs)

    def __call__(self, batch: Batch, precision: str | None = None) -> torch.Tensor:
        with self.autocast(precision):
            loss = self.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return loss.detach()


# --------------------------------------------------------------------------------------------------- windows


def staged_batches(feed: DeviceFeed) -> Iterator[tuple[float, Batch]]:
    """Yield ``(seconds blocked in next(), model-ready batch)`` from the pipeline's feed, as ``VlfitTrainer`` takes
    them (see the module docstring)."""
    for batch in feed:
        yield feed.last_wait, batch


def timed_window(
    batches: Iterator[tuple[float, Batch]],
    step: Callable[[Batch], Any] | None,
    *,
    device: torch.device,
    batch_size: int,
    warmup_steps: int,
    steps: int,
    max_settle_steps: int,
) -> Window:
    """Warm up, settle, then time ``steps`` steps (see the module docstring).

    Args:
        batches: ``(wait seconds, batch)`` pairs from ``staged_batches``.
        step: The training step; None measures the data path alone (loader mode).
        device: Where the batches land (synchronized at the window's ends).
        batch_size: Samples per batch.
        warmup_steps: Excluded steps first.
        steps: Timed steps.
        max_settle_steps: Most excluded steps spent waiting for the prefetch queue to drain.

    Raises:
        RuntimeError: when the loader runs out of batches before the window ends.
    """

    def advance() -> tuple[float, float]:
        started = time.perf_counter()
        try:
            waited, batch = next(batches)
        except StopIteration:
            raise RuntimeError("the loader ran out of batches before the timed window ended") from None
        if step is not None:
            step(batch)
        return waited, time.perf_counter() - started

    for _ in range(warmup_steps):
        advance()
    settle = 0
    for _ in range(max_settle_steps):
        synchronize(device)
        waited, took = advance()
        settle += 1
        if waited > STARVED_WAIT_SHARE * took:
            break
    synchronize(device)
    meter = ThroughputMeter()
    for _ in range(steps):
        waited, _ = advance()
        meter.add(waited, batch_size)
    synchronize(device)
    figures = meter.total()
    seconds = time.perf_counter() - meter.start
    return Window(figures["samples_per_second"], figures["data_wait_share"], seconds, steps, settle)


def compute_window(
    batch: Batch,
    step: Callable[[Batch], Any],
    *,
    device: torch.device,
    batch_size: int,
    warmup_steps: int,
    steps: int,
) -> Window:
    """The compute ceiling: ``step`` on the same model-ready batch again and again (no data path at all)."""
    for _ in range(warmup_steps):
        step(batch)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    synchronize(device)
    seconds = max(time.perf_counter() - start, 1e-9)
    return Window(steps * batch_size / seconds, 0.0, seconds, steps)


# ----------------------------------------------------------------------------------------------- stage profile


class StageClock:
    """Accumulates seconds per named stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, device: torch.device | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if device is not None:
                synchronize(device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def per_batch_ms(self, batches: int) -> dict[str, float]:
        """Milliseconds per batch of each stage."""
        return {name: 1000.0 * value / max(batches, 1) for name, value in self.seconds.items()}
