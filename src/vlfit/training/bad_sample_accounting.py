"""The trainer's account of its bad samples: the running check against ``--max_bad_fraction``, the whole-run
judgement of a run too short for it, totals over every process, and the report written when a run stops for them.

A mixin of ``VlfitTrainer`` (it uses the trainer's ``bad_samples`` ledger, ``args`` and ``accelerator``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vlfit.data.bad_samples import BAD_SAMPLES_REPORT
from vlfit.training.bad_sample_ledger import BadSampleLedger, TooManyBadSamplesError, process_file_name


class BadSampleAccounting:
    bad_samples: BadSampleLedger
    args: Any
    accelerator: Any

    def _check_bad_fraction(self) -> None:
        try:
            self.bad_samples.check()
        except TooManyBadSamplesError:
            self.write_bad_samples_report()
            raise

    def judge_whole_run(self) -> tuple[int, int]:
        """The run's bad samples and samples read, summed over every process, after judging them as a whole
        (``BadSampleLedger.judge_whole_run``: a run too short for the running check). A collective.

        Raises:
            TooManyBadSamplesError: after writing the bad-sample report, when the run lost too much.
        """
        bad, read = self.bad_sample_totals()
        try:
            self.bad_samples.judge_whole_run(bad, read)
        except TooManyBadSamplesError:
            self.write_bad_samples_report()
            raise
        return bad, read

    def bad_sample_totals(self) -> tuple[int, int]:
        """Bad samples skipped and samples read, summed over every process (a collective in distributed runs)."""
        totals = torch.tensor(
            [self.bad_samples.count, self.bad_samples.samples_read], dtype=torch.long, device=self.args.device
        )
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        return int(totals[0]), int(totals[1])

    def write_bad_samples_report(self) -> str:
        """Write this process's bad samples to ``bad_samples.jsonl`` in the output folder; returns the path."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        path = os.path.join(self.args.output_dir, process_file_name(BAD_SAMPLES_REPORT, self.args.process_index))
        self.bad_samples.write_report(path)
        return path
