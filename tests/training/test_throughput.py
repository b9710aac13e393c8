"""ThroughputMeter: samples/s and data-wait share, with optimum-habana's --throughput_warmup_steps."""

import json

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
    assert meter.window() == {}  # nothing served since the warm-up ended: no figure rather than a zero
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


def test_total_ends_with_the_last_step(clock):
    # After its last step a run logs, saves its model and may have fetched batches for a step it never ran: no
    # step's time, and no samples trained.
    meter = ThroughputMeter(warmup_steps=1)
    for _ in range(3):
        _run_step(meter, clock, seconds=1.0, wait=0.5, samples=8)
    meter.add(3.0, 8)
    clock.now += 10.0
    assert meter.total() == {"samples_per_second": 8.0, "data_wait_share": 0.5}


@pytest.mark.parametrize(("processes", "warmup_steps"), [(0, 0), (1, -1)])
def test_bad_arguments_are_refused(processes, warmup_steps):
    with pytest.raises(ValueError):
        ThroughputMeter(processes=processes, warmup_steps=warmup_steps)


@pytest.mark.slow
def test_train_leaves_the_warmup_steps_out_of_its_logs_and_metrics(tmp_path, synthetic_dataset_dir):
    from tests.training.train_runs import tiny_train_argv
    from vlfit.cli import main

    out = tmp_path / "run"
    argv = tiny_train_argv(synthetic_dataset_dir, out, "--throughput_warmup_steps", "2", steps=4)
    assert main(["train", *argv]) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    logged = {entry["step"]: entry for entry in state["log_history"] if "loss" in entry}
    assert sorted(logged) == [1, 2, 3, 4]
    assert all("samples_per_second" not in logged[step] for step in (1, 2))
    assert all(logged[step]["samples_per_second"] > 0 for step in (3, 4))
    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_samples_per_second"] > 0 and metrics["train_flops_per_sample"] > 0
    assert metrics["train_mfu"] == pytest.approx(metrics["train_tflops_per_second"] / metrics["train_peak_tflops"])
