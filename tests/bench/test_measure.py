"""The measurement window (warm-up, settle, timed steps) and the host-memory readings."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from vlfit.bench.measure import PeakHostMemory, host_rss_bytes, summarize, timed_window


def _batches(waits: list[float]) -> Iterator[tuple[float, dict]]:
    """Batches that each take ``wait`` seconds to arrive, reporting the time actually spent (as a loader's feed
    does): on a busy machine a sleep overshoots, and the window must count what was waited, not what was asked."""
    for wait in waits:
        if not wait:
            yield 0.0, {}
            continue
        started = time.perf_counter()
        time.sleep(wait)
        yield time.perf_counter() - started, {}


def test_window_settles_until_a_step_waits_then_times_the_steps() -> None:
    # Three batches were buffered during warm-up (no wait), then every batch takes 20 ms to arrive.
    waits = [0.0, 0.0, 0.0, 0.0] + [0.02] * 6
    window = timed_window(_batches(waits), lambda batch: None, device=torch.device("cpu"), batch_size=4,
                          warmup_steps=1, steps=4, max_settle_steps=5)  # fmt: skip
    assert window.settle_steps == 4  # three buffered batches, then the first that waited
    assert window.steps == 4
    assert window.data_wait_share > 0.5  # the steps themselves do nothing: the window is almost all waiting
    # The buffered batches were not counted: each timed batch took at least 20 ms, so at most 4 / 0.02 samples/s.
    assert window.samples_per_second <= 4 / 0.02
    with pytest.raises(RuntimeError, match="ran out of batches"):
        timed_window(_batches([0.0] * 3), None, device=torch.device("cpu"), batch_size=1, warmup_steps=1, steps=5,
                     max_settle_steps=0)  # fmt: skip


def test_summary_is_the_median_with_min_and_max() -> None:
    windows = [timed_window(_batches([0.0] * 3), None, device=torch.device("cpu"), batch_size=1, warmup_steps=0,
                            steps=3, max_settle_steps=0) for _ in range(3)]  # fmt: skip
    figures = summarize(windows)
    rates = sorted(w.samples_per_second for w in windows)
    assert figures["samples_per_second"] == rates[1]
    assert (figures["samples_per_second_min"], figures["samples_per_second_max"]) == (rates[0], rates[2])
    assert len(figures["repeats"]) == 3


def test_host_memory_sees_the_peak() -> None:
    grown = host_rss_bytes() + 32 * 2**20
    with PeakHostMemory(interval_s=0.01) as peak:
        block = bytearray(64 * 2**20)  # touch 64 MiB while the sampler runs
        deadline = time.monotonic() + 30  # however busy the machine, the sampler gets to run in the end
        while (peak.peak_bytes or 0) < grown and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    assert peak.peak_bytes >= grown
