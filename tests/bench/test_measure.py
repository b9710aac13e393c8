"""The measurement window (warm-up, settle, timed steps) and the host-memory readings."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch

from vlfit.bench.measure import PeakHostMemory, host_rss_bytes, summarize, timed_window
from vlfit.bench.plan import SweepPlan
from vlfit.bench.session import BenchSession
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.efficiency.flops import count_flops
from vlfit.models.family import LOCAL_LOSS
from vlfit.models.itm import has_itm_head
from vlfit.models.loading import build_model, resolve_model
from vlfit.training.itm_objective import TrainingObjective


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


@pytest.fixture(scope="module")
def objective_sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BenchSession]:
    """Train-mode sessions of the tiny preset, one per objective, on the same weights and samples."""
    source = synthetic_source(8, min_long_side=160, max_long_side=320)
    spec = resolve_model(model_preset="tiny", captions=source.captions, max_seq_length=32)
    torch.manual_seed(0)
    model = build_model(spec)
    assert not has_itm_head(model)
    sessions = {}
    for objective in ("contrastive", "contrastive+itm"):
        plan = SweepPlan(pipelines=["fast"], workers=[0], batch_size=4, steps=1, warmup_steps=0, repeats=1,
                         max_seq_length=32, objective=objective)  # fmt: skip
        sessions[objective] = BenchSession(source, spec.inputs, torch.device("cpu"), plan, model=copy.deepcopy(model),
                                           family=spec.family, cache_dir=str(tmp_path_factory.mktemp("objective")),
                                           source_key="objective")  # fmt: skip
    return sessions


def test_the_bench_step_of_contrastive_itm_counts_the_fused_passes(objective_sessions) -> None:
    plain, matched = objective_sessions["contrastive"], objective_sessions["contrastive+itm"]
    assert plain.step is not None and matched.step is not None
    # The model was prepared as training prepares it: a matching head added and trained.
    assert has_itm_head(matched.step.model) and matched.step.model.itm_score.fc.weight.requires_grad
    assert not has_itm_head(plain.step.model)
    shapes = [{key: tuple(value.shape) for key, value in s.ready_batch().inputs.items()} for s in (plain, matched)]
    assert shapes[0] == shapes[1]  # the same batch: the same samples, order and padding
    steps = matched.step.steps_taken
    assert matched.flops_per_sample() > 1.2 * plain.flops_per_sample()
    assert matched.step.steps_taken == steps + 1  # a real step: the next one draws its own negatives


@pytest.mark.slow
def test_the_bench_counts_what_the_training_objective_counts(objective_sessions) -> None:
    """A third and fourth FLOP count (seconds each on a busy CPU): the bench's step against the training objective's
    forward and backward on the same batch (clipping and AdamW have no matrix work to count)."""
    matched = objective_sessions["contrastive+itm"]
    assert matched.step is not None
    batch = matched.ready_batch()
    objective = TrainingObjective("contrastive+itm")

    def training_step() -> None:
        objective.loss(matched.step.family, matched.step.model, batch.inputs, step=0, scope=LOCAL_LOSS).backward()

    _, trained = count_flops(training_step)
    assert matched.flops_per_sample() == pytest.approx(trained / len(batch), rel=1e-9)
