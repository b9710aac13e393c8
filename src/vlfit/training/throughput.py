"""Samples/s and data-wait share, per logging window and over the whole run, after an optional warm-up."""

from __future__ import annotations

import time

from vlfit.errors import ConfigError


class ThroughputMeter:
    """Accumulates time blocked waiting for batches and samples served.

    ``data_wait_share`` is the time spent blocked in ``next()`` on the loader divided by wall time: 0 means the
    model never waited for data; near 1 means the input pipeline is the bottleneck.

    The first ``warmup_steps`` optimizer steps are left out of both figures, as optimum-habana's
    ``--throughput_warmup_steps`` does: their samples are not counted and the clock restarts when the last of them
    ends, because compilation, autotuning and loader start-up make the first steps slow. The whole run's figures
    (``total``) end where its last step ended: what the run does after training (its last log, saving the model)
    is no step's time, nor are batches fetched for a step that never ran. Call it like this::

        meter = ThroughputMeter(processes=world_size, warmup_steps=args.throughput_warmup_steps)
        for each optimizer step:
            meter.add(seconds_blocked_on_the_loader, samples_in_the_step)  # once or more per step
            ...forward, backward, optimizer step...
            meter.step()
            if logging: logs.update(meter.window())
        metrics.update(meter.total())

    Args:
        processes: Processes training in step (DDP), each serving as many samples as this one: samples/s is
            reported for all of them together, the data-wait share for this one.
        warmup_steps: Optimizer steps, counted by ``step()``, left out of the figures. 0 counts from the start.

    Raises:
        ValueError: ``processes`` is below 1 or ``warmup_steps`` is negative.
    """

    def __init__(self, processes: int = 1, warmup_steps: int = 0) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        if warmup_steps < 0:
            raise ConfigError(f"--throughput_warmup_steps must be at least 0, got {warmup_steps}")
        self.processes = processes
        self.warmup_steps = warmup_steps
        self.steps = 0
        self._reset()

    def _reset(self) -> None:
        self.start = self.window_start = time.perf_counter()
        self.wait_seconds = self.window_wait_seconds = 0.0
        self.samples = self.window_samples = 0
        self._last_step: tuple[float, float, int] | None = None  # (its end, wait and samples so far), for total()

    @property
    def warming_up(self) -> bool:
        """True until ``step()`` was called ``warmup_steps`` times."""
        return self.steps < self.warmup_steps

    def add(self, wait_seconds: float, samples: int) -> None:
        """Count ``samples`` served after blocking ``wait_seconds`` on the loader (during warm-up too)."""
        self.wait_seconds += wait_seconds
        self.window_wait_seconds += wait_seconds
        self.samples += samples
        self.window_samples += samples

    def step(self) -> None:
        """Mark the end of an optimizer step; the end of the last warm-up step starts the measurement."""
        self.steps += 1
        if self.steps == self.warmup_steps:
            self._reset()  # what was counted so far belongs to the warm-up
        else:
            self._last_step = (time.perf_counter(), self.wait_seconds, self.samples)

    def window(self) -> dict[str, float]:
        """Figures since the previous call (or the end of the warm-up); starts a new window.

        Returns:
            ``samples_per_second`` and ``data_wait_share``; empty during the warm-up and for a window that served
            nothing (the one ending with the warm-up), which have nothing to report.
        """
        if self.warming_up or not self.window_samples:
            return {}
        figures = _figures(
            self.window_samples * self.processes, self.window_wait_seconds, time.perf_counter() - self.window_start
        )
        self.window_start = time.perf_counter()
        self.window_wait_seconds, self.window_samples = 0.0, 0
        return figures

    def total(self) -> dict[str, float]:
        """Figures from the end of the warm-up (or from when the meter was made when there is none) to the end of
        the last step (to now when ``step()`` was never called after the warm-up).

        A run that ends during its warm-up has nothing else to measure: the figures then cover the warm-up
        steps too (``warming_up`` tells the caller so).
        """
        end, wait_seconds, samples = self._last_step or (time.perf_counter(), self.wait_seconds, self.samples)
        return _figures(samples * self.processes, wait_seconds, end - self.start)


def _figures(samples: int, wait_seconds: float, elapsed: float) -> dict[str, float]:
    elapsed = max(elapsed, 1e-9)
    return {"samples_per_second": samples / elapsed, "data_wait_share": min(wait_seconds / elapsed, 1.0)}
