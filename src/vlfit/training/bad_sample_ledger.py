"""A training run's record of the bad samples its batches met: counts, ``--max_bad_fraction``, the report file,
checkpointed state, and a log that stays short on dirty data.

A streamed split's shards given up after their retries (``vlfit.data.stream``: a 404, an HTML page, a server that
kept failing) are judged as shards, at once: more than ``--max_bad_fraction`` of a source's shards lost stops the
run naming them, however few samples were read (a lost shard is many samples, not the one record it is listed as).

Every bad sample is kept (``bad_samples.jsonl`` lists each one); the log names the first few and then a summary
every ``LOG_SUMMARY_EVERY`` bad samples, as open_clip's ``log_and_continue`` does, so a dirty run's log does not
grow with its data.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vlfit.atomic_files import replace_on_success
from vlfit.data.bad_samples import BAD_SAMPLES_REPORT, MIN_SAMPLES_FOR_BAD_FRACTION
from vlfit.data.batch import WORKER, BadSample
from vlfit.errors import DataError

logger = logging.getLogger(__name__)

# The ledger's state in each checkpoint (so a resumed run keeps counting); the report goes to BAD_SAMPLES_REPORT.
BAD_SAMPLES_CHECKPOINT_FILE = "bad_samples.json"
# The first this many bad samples are logged one by one; after that, one summary line per this many more.
LOG_FIRST = 10
LOG_SUMMARY_EVERY = 100


class TooManyBadSamplesError(DataError):
    """More than ``--max_bad_fraction`` of the samples read so far were bad."""


def min_samples_for_fraction(max_bad_fraction: float, split_size: int | None = None) -> int:
    """How many samples must have been read before ``max_bad_fraction`` is enforced.

    A split smaller than that is judged once all of it was read (a split of 20 with 5 bad images is 25% bad, however
    few samples that is), so the limit applies to small splits too.
    """
    if max_bad_fraction <= 0:
        return 1  # zero tolerance: the first bad sample is already too many
    needed = max(MIN_SAMPLES_FOR_BAD_FRACTION, math.ceil(1.0 / max_bad_fraction))
    return min(needed, split_size) if split_size else needed


def process_file_name(name: str, process_index: int) -> str:
    """``name`` for process 0, ``stem_N.ext`` for process N (each process writes its own file)."""
    if process_index == 0:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}_{process_index}{dot}{ext}"


@dataclass(frozen=True)
class BadSampleRecord:
    """One skipped sample, as written to ``bad_samples.jsonl``.

    Attributes:
        id: The sample id.
        reason: Why it was skipped.
        step: The optimizer step whose batch it would have been in (1-based).
        stage: ``worker`` (replaced by a substitute) or ``device`` (dropped from its batch at device decode).
    """

    id: str
    reason: str
    step: int
    stage: str = WORKER


class BadSampleLedger:
    """Counts samples read and bad samples skipped during a run, and enforces ``--max_bad_fraction``.

    Args:
        max_bad_fraction: Largest tolerated share of bad samples among those read (1.0: never abort).
        log: Log bad samples as they are added (the first ``LOG_FIRST``, then a summary every
            ``LOG_SUMMARY_EVERY``).
        split_size: Samples in the split: one smaller than ``min_samples_for_fraction`` is judged once read whole.
        shard_sources: A streamed split's sources as ``(spec, shard URLs)``: a bad sample whose id is one of these
            URLs is a lost shard, judged against its source's shard count.
    """

    def __init__(
        self,
        max_bad_fraction: float = 1.0,
        log: bool = False,
        split_size: int | None = None,
        shard_sources: Sequence[tuple[str, Sequence[str]]] = (),
    ) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.log = log
        self.split_size = split_size
        self.shard_sources = [(spec, tuple(urls)) for spec, urls in shard_sources]
        self._source_of = {url: i for i, (_, urls) in enumerate(self.shard_sources) for url in urls}
        self.samples_read = 0
        self.records: list[BadSampleRecord] = []

    def lost_shards(self) -> dict[int, list[str]]:
        """Per source (its position in ``shard_sources``), the distinct shards given up, in the order met."""
        lost: dict[int, dict[str, None]] = {}
        for record in self.records:
            source = self._source_of.get(record.id)
            if source is not None:
                lost.setdefault(source, {})[record.id] = None
        return {source: list(urls) for source, urls in lost.items()}

    @property
    def count(self) -> int:
        """Number of bad samples so far."""
        return len(self.records)

    @property
    def fraction(self) -> float:
        """Bad samples over samples read (0 before anything was read)."""
        return self.count / self.samples_read if self.samples_read else 0.0

    def add(self, bad: Iterable[BadSample], *, rows: int, step: int) -> None:
        """Record one batch.

        Args:
            bad: The batch's bad samples. Worker-stage ones were read in addition to the batch's rows (each was
                replaced or left out), device-stage ones were dropped from it: either way, not among its rows.
            rows: Samples the batch delivered.
            step: The optimizer step the batch belongs to.
        """
        bad = list(bad)
        before = self.count
        self.samples_read += rows + len(bad)
        self.records.extend(BadSampleRecord(b.id, b.reason, step, b.stage) for b in bad)
        if self.log:
            self._log(before)

    def _log(self, before: int) -> None:
        for record in self.records[before:LOG_FIRST]:
            how = "dropped from its batch at device decode" if record.stage != WORKER else "skipped"
            logger.warning("%s bad sample %s: %s", how, record.id, record.reason)
        if self.count > LOG_FIRST and before // LOG_SUMMARY_EVERY != self.count // LOG_SUMMARY_EVERY:
            logger.warning(
                "%d bad samples so far (%.2f%% of %d read; only the first %d are logged one by one): every id and "
                "reason goes to %s",
                self.count, 100 * self.fraction, self.samples_read, LOG_FIRST, BAD_SAMPLES_REPORT,
            )  # fmt: skip

    def check(self) -> None:
        """Raise ``TooManyBadSamplesError`` when a source lost more than ``--max_bad_fraction`` of its shards, or
        when the bad fraction of samples is over the limit (once enough were read)."""
        if self.max_bad_fraction >= 1.0 or not self.records:
            return
        for source, urls in self.lost_shards().items():
            spec, shards = self.shard_sources[source]
            if len(urls) / len(shards) > self.max_bad_fraction:
                named = "; ".join(urls[:5]) + ("; ..." if len(urls) > 5 else "")
                raise TooManyBadSamplesError(
                    f"{len(urls)} of the {len(shards)} shards of {spec} could not be read ({named}), over "
                    f"--max_bad_fraction {self.max_bad_fraction:g} of what the run was asked to read. Each reason is "
                    f"in {BAD_SAMPLES_REPORT} in the output folder: fix the URLs or the server, or leave those shards "
                    "out of the spec."
                )
        if self.samples_read < min_samples_for_fraction(self.max_bad_fraction, self.split_size):
            return
        if self.fraction > self.max_bad_fraction:
            first = "; ".join(f"{r.id} ({r.reason})" for r in self.records[:3])
            raise TooManyBadSamplesError(
                f"{self.count} of the {self.samples_read} samples read so far were bad ({self.fraction:.1%}), over "
                f"--max_bad_fraction {self.max_bad_fraction:g}. First ones: {first}. Every skipped id and reason is "
                f"in {BAD_SAMPLES_REPORT} in the output folder: fix or filter the data, or raise --max_bad_fraction."
            )

    def judge_whole_run(self, bad: int, read: int) -> None:
        """At the end of a run, judge everything it read (``bad`` of ``read`` samples, every process's) when the
        running check never could: fewer samples were read than ``min_samples_for_fraction`` asks for (a short
        streamed run, whose length is known only now, or ``--max_steps`` ending before a small split was read whole).

        Raises:
            TooManyBadSamplesError: when ``bad / read`` is over ``--max_bad_fraction``.
        """
        limit = self.max_bad_fraction
        if limit >= 1.0 or not read or bad / read <= limit:
            return
        if read >= min_samples_for_fraction(limit, self.split_size):
            return  # the running check judged these (and would have stopped the run)
        first = "; ".join(f"{r.id} ({r.reason})" for r in self.records[:3])
        raise TooManyBadSamplesError(
            f"{bad} of the {read} samples the run read were bad ({bad / read:.1%}), over --max_bad_fraction "
            f"{limit:g}, judged at the end of a run too short to judge as it went. First ones: {first}. Every skipped "
            f"id and reason is in {BAD_SAMPLES_REPORT} in the output folder: fix or filter the data, or raise "
            "--max_bad_fraction."
        )

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serializable snapshot (saved in checkpoints so that a resumed run keeps counting)."""
        return {"samples_read": self.samples_read, "records": [asdict(r) for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` snapshot."""
        self.samples_read = int(state.get("samples_read", 0))
        self.records = [BadSampleRecord(**r) for r in state.get("records", [])]

    def save(self, folder: str, process_index: int = 0) -> None:
        """Write the snapshot into ``folder`` (a checkpoint), one file per process."""
        path = os.path.join(folder, process_file_name(BAD_SAMPLES_CHECKPOINT_FILE, process_index))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f)

    def load(self, folder: str, process_index: int = 0) -> bool:
        """Restore the snapshot a checkpoint holds; False (and nothing changed) when it holds none."""
        path = os.path.join(folder, process_file_name(BAD_SAMPLES_CHECKPOINT_FILE, process_index))
        try:
            with open(path, encoding="utf-8") as f:
                self.load_state_dict(json.load(f))
        except FileNotFoundError:
            return False
        return True

    def write_report(self, path: str) -> None:
        """Write one JSON line per bad sample to ``path`` (replaced atomically)."""
        with replace_on_success(path) as temp, open(temp, "w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
