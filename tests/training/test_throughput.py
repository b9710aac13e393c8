"""ThroughputMeter: samples/s and data-wait share, with optimum-habana's --throughput_warmup_steps."""

import pytest

from vlfit.training import throughput
from vlfit.training.throughput import ThroughputMeter


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter: ``clock.now`` is what it returns."""

    class Clock:
        now = 0.0

    fake = Clock()
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: fake.now)
    return fake


def _run_step(meter: ThroughputMeter, clock, *, seconds: float, wait: float, samples: int) -> None:
    meter.add(wait, samples)
    clock.now += seconds
    meter.step()


def test_without_warmup_every_step_counts(clock):
    meter = ThroughputMeter()
    for _ in range(3):
        _run_step(meter, clock, seconds=1.0, wait=0.25, samples=8)
    assert meter.window() == {"samples_per_second": 8.0, "data_wait_share": 0.25}
    assert meter.total() == {"samples_per_second": 8.0, "data_wait_share": 0.25}


def test_warmup_steps_are_left_out_of_samples_per_second(clock):
    meter = ThroughputMeter(processes=2, warmup_steps=2)
    # Two slow warm-up steps (compilation) that waited a lot for the first batches.
    _run_step(meter, clock, seconds=10.0, wait=5.0, samples=8)
    assert meter.warming_up
    assert meter.window() == {}  # nothing to report while warming up
    _run_step(meter, clock, seconds=10.0, wait=5.0, samples=8)
    assert not meter.warming_up
    for _ in range(4):
        _run_step(meter, clock, seconds=1.0, wait=0.5, samples=8)
    expected = {"samples_per_second": 16.0, "data_wait_share": 0.5}  # 8 samples x 2 processes per second
    assert meter.window() == expected
    assert meter.total() == expected


def test_window_after_warmup_starts_at_its_end(clock):
    meter = ThroughputMeter(warmup_steps=1)
    _run_step(meter, clock, seconds=100.0, wait=0.0, samples=4)
    assert meter.window() == {"samples_per_second": 0.0, "data_wait_share": 0.0}  # 0 s since the warm-up ended
    _run_step(meter, clock, seconds=2.0, wait=1.0, samples=4)
    assert meter.window() == {"samples_per_second": 2.0, "data_wait_share": 0.5}


def test_run_shorter_than_its_warmup_reports_the_warmup(clock):
    meter = ThroughputMeter(warmup_steps=5)
    for _ in range(2):
        _run_step(meter, clock, seconds=2.0, wait=0.0, samples=4)
    assert meter.warming_up
    assert meter.total() == {"samples_per_second": 2.0, "data_wait_share": 0.0}


def test_several_batches_per_step_are_summed(clock):
    # Gradient accumulation: add() once per batch, step() once per optimizer step.
    meter = ThroughputMeter(warmup_steps=1)
    for _ in range(3):
        for _ in range(4):
            meter.add(0.0, 2)
        clock.now += 1.0
        meter.step()
    assert meter.total()["samples_per_second"] == 8.0


@pytest.mark.parametrize(("processes", "warmup_steps"), [(0, 0), (1, -1)])
def test_bad_arguments_are_refused(processes, warmup_steps):
    with pytest.raises(ValueError):
        ThroughputMeter(processes=processes, warmup_steps=warmup_steps)
