"""Samples/s and data-wait share, per logging window and over the whole run."""

from __future__ import annotations

import time


class ThroughputMeter:
    """Accumulates time blocked waiting for batches and samples served.

    ``data_wait_share`` is the time spent blocked in ``next()`` on the loader divided by wall time: 0 means the
    model never waited for data; near 1 means the input pipeline is the bottleneck.

    Args:
        processes: Processes training in step (DDP), each serving as many samples as this one: samples/s is
            reported for all of them together, the data-wait share for this one.
    """

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self.start = self.window_start = time.perf_counter()
        self.wait_seconds = self.window_wait_seconds = 0.0
        self.samples = self.window_samples = 0

    def add(self, wait_seconds: float, samples: int) -> None:
        self.wait_seconds += wait_seconds
        self.window_wait_seconds += wait_seconds
        self.samples += samples
        self.window_samples += samples

    def window(self) -> dict[str, float]:
        """Figures since the previous call (or the start); starts a new window."""
        figures = _figures(
            self.window_samples * self.processes, self.window_wait_seconds, time.perf_counter() - self.window_start
        )
        self.window_start = time.perf_counter()
        self.window_wait_seconds, self.window_samples = 0.0, 0
        return figures

    def total(self) -> dict[str, float]:
        """Figures since the meter was made."""
        return _figures(self.samples * self.processes, self.wait_seconds, time.perf_counter() - self.start)


def _figures(samples: int, wait_seconds: float, elapsed: float) -> dict[str, float]:
    elapsed = max(elapsed, 1e-9)
    return {"samples_per_second": samples / elapsed, "data_wait_share": min(wait_seconds / elapsed, 1.0)}
