"""Samples/s and data-wait share between two logging steps."""

from __future__ import annotations

import time


class ThroughputMeter:
    """Accumulates time blocked waiting for batches and samples served, per logging window.

    ``data_wait_share`` is the time spent blocked in ``next()`` on the loader divided by the wall time of the
    window: 0 means the model never waited for data; near 1 means the input pipeline is the bottleneck.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.wait_seconds = 0.0
        self.samples = 0

    def add(self, wait_seconds: float, samples: int) -> None:
        self.wait_seconds += wait_seconds
        self.samples += samples

    def window(self) -> dict[str, float]:
        """Return the window's figures and start a new window."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        figures = {
            "samples_per_second": self.samples / elapsed,
            "data_wait_share": min(self.wait_seconds / elapsed, 1.0),
        }
        self.reset()
        return figures
