"""The training run's bad-sample ledger: counts, ``--max_bad_fraction``, checkpointed state, the report file, and
a log that names the first few bad samples and then only summarizes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vlfit.data.batch import DEVICE, BadSample
from vlfit.training.bad_sample_ledger import (
    LOG_FIRST,
    LOG_SUMMARY_EVERY,
    BadSampleLedger,
    TooManyBadSamplesError,
    min_samples_for_fraction,
)


def test_max_bad_fraction_is_judged_only_after_enough_samples() -> None:
    assert min_samples_for_fraction(0.01) == 100 and min_samples_for_fraction(0.001) == 1000
    assert min_samples_for_fraction(0.5) == 100 and min_samples_for_fraction(0.0) == 1
    # A split smaller than that is judged once read whole.
    assert min_samples_for_fraction(0.01, split_size=20) == 20 and min_samples_for_fraction(0.01, split_size=500) == 100
    ledger = BadSampleLedger(max_bad_fraction=0.01)
    ledger.add([BadSample("x", "caption is empty")], rows=8, step=1)  # 1 bad of 9 read: 11%, but only 9 samples
    ledger.check()
    for step in range(2, 13):
        ledger.add([], rows=8, step=step)
    ledger.check()  # 1 of 97: still under 100 read
    ledger.add([BadSample("y", "image is empty (0 bytes)")], rows=8, step=13)  # 2 of 106: 1.9%
    with pytest.raises(TooManyBadSamplesError, match=r"2 of the 106 samples read so far were bad \(1\.9%\).*x \("):
        ledger.check()
    small = BadSampleLedger(max_bad_fraction=0.01, split_size=20)
    small.add([BadSample("s", "caption is empty")], rows=8, step=1)
    small.check()  # 9 of a split of 20 read
    small.add([], rows=12, step=2)
    with pytest.raises(TooManyBadSamplesError, match=r"1 of the 21 samples"):
        small.check()
    never = BadSampleLedger(max_bad_fraction=1.0)
    never.add([BadSample("z", "r")] * 50, rows=0, step=1)
    never.check()
    zero = BadSampleLedger(max_bad_fraction=0.0)
    zero.add([BadSample("z", "r")], rows=7, step=1)
    with pytest.raises(TooManyBadSamplesError):
        zero.check()


def test_ledger_counts_replaced_and_dropped_samples_as_read_once(tmp_path: Path) -> None:
    ledger = BadSampleLedger()
    # A batch of 4: one sample replaced in a worker (5 read), then one dropped at device decode (3 delivered).
    ledger.add([BadSample("w", "worker"), BadSample("d", "device", DEVICE)], rows=3, step=1)
    assert ledger.samples_read == 5 and ledger.count == 2 and ledger.fraction == pytest.approx(0.4)
    ledger.save(str(tmp_path))
    restored = BadSampleLedger()
    assert restored.load(str(tmp_path)) and restored.state_dict() == ledger.state_dict()
    assert not BadSampleLedger().load(str(tmp_path / "missing"))
    ledger.save(str(tmp_path), process_index=1)
    assert (tmp_path / "bad_samples_1.json").is_file()
    ledger.write_report(str(tmp_path / "bad.jsonl"))
    lines = (tmp_path / "bad.jsonl").read_text().splitlines()
    assert lines == [
        '{"id": "w", "reason": "worker", "step": 1, "stage": "worker"}',
        '{"id": "d", "reason": "device", "step": 1, "stage": "device"}',
    ]


def test_a_dirty_run_logs_the_first_few_then_a_summary_every_n(caplog: pytest.LogCaptureFixture) -> None:
    ledger = BadSampleLedger(log=True)
    total = 3 * LOG_SUMMARY_EVERY + 7
    with caplog.at_level(logging.WARNING, logger="vlfit"):
        for step in range(total // 7 + 1):
            ledger.add([BadSample(f"s{step}-{i}", "image is empty") for i in range(7)], rows=41, step=step)
    named = [r for r in caplog.records if "bad sample s" in r.getMessage()]
    summaries = [r for r in caplog.records if "bad samples so far" in r.getMessage()]
    assert len(named) == LOG_FIRST and "s0-0" in named[0].getMessage()
    assert len(summaries) == ledger.count // LOG_SUMMARY_EVERY  # one per LOG_SUMMARY_EVERY, not one per sample
    assert ledger.count >= total and len(ledger.records) == ledger.count  # every one is still recorded
