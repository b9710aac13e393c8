"""Bad samples: what counts as one, what ``--bad_sample_policy`` does with it, and the run's ledger of them.

A sample is bad when its record cannot be read (``BadRecordError``), its image cannot be decoded (``DecodeError``:
corrupt or truncated data, an unknown format, a decompression bomb) or its caption is missing, empty or only
whitespace. Captions are never bad for their bytes: invalid UTF-8 is decoded with U+FFFD replacement characters
(one mis-encoded accent should not cost the whole pair), and over-long captions are truncated by the tokenizer.

Policies:

- ``skip`` (default): the dataset replaces the bad sample by a deterministic substitute (``substitute_index``),
  so training batches keep their size, and reports ``(id, reason)`` in the batch's ``bad_samples`` list; the
  trainer counts them in its logs, metrics and ``bad_samples.jsonl``.
- ``raise``: the first bad sample stops the run with ``BadSampleError`` naming the sample and the reason.

``--max_bad_fraction`` bounds ``skip``: the run stops with ``TooManyBadSamplesError`` once more than that fraction
of the samples read so far were bad. The fraction is only judged after ``min_samples_for_fraction`` samples, so a
single bad sample early in a run never reads as a high rate.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

BAD_SAMPLE_POLICIES: tuple[str, ...] = ("skip", "raise")
# The fraction is judged only after at least this many samples were read (and at least 1/max_bad_fraction, so
# that one bad sample alone can never exceed the limit): small samples give noisy rates.
MIN_SAMPLES_FOR_BAD_FRACTION = 100
# How many substitutes ``skip`` tries for one index before concluding the data is mostly unreadable.
MAX_SUBSTITUTE_ATTEMPTS = 16
# Name of the ledger file: in ``--output_dir`` (one line per bad sample) and in each checkpoint (to resume counts).
BAD_SAMPLES_REPORT = "bad_samples.jsonl"
BAD_SAMPLES_CHECKPOINT_FILE = "bad_samples.json"

# What ``--bad_sample_policy raise`` tells the user to do.
RAISE_HINT = (
    "--bad_sample_policy raise stops at the first bad sample: remove or fix this sample, or pass "
    "--bad_sample_policy skip to replace bad samples and count them"
)

BadSampleInfo = tuple[str, str]
"""``(sample id, reason)`` as carried in a batch's ``bad_samples`` list."""


class BadSampleError(ValueError):
    """A sample cannot be used: raised by ``--bad_sample_policy raise``, or when no usable substitute was found.

    Build it with ``for_sample``. The constructor takes the message alone because that is how torch re-raises a
    DataLoader worker's exception in the main process (``type(message)``): the type survives, the attributes
    are then ``None``.

    Attributes:
        sample_id: The sample's id (or ``row N`` when the record could not even be read).
        reason: What is wrong with it.
    """

    def __init__(self, message: str, sample_id: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.sample_id = sample_id
        self.reason = reason

    @classmethod
    def for_sample(cls, sample_id: str, reason: str, hint: str = "") -> BadSampleError:
        """``bad sample <id>: <reason>. <hint>``."""
        return cls(f"bad sample {sample_id}: {reason}" + (f". {hint}" if hint else ""), sample_id, reason)


class TooManyBadSamplesError(RuntimeError):
    """More than ``--max_bad_fraction`` of the samples read so far were bad."""


class BadCaptionError(ValueError):
    """A caption is missing, empty or whitespace only (the message names the sample)."""


def clean_caption(caption: Any, sample_id: str) -> str:
    """Return the caption as text, or raise ``BadCaptionError`` when there is no usable text.

    Bytes are decoded as UTF-8 with replacement characters; other non-text values are rendered with ``str``.

    Raises:
        BadCaptionError: for ``None``, an empty caption or one that is only whitespace.
    """
    if caption is None:
        raise BadCaptionError(f"sample {sample_id}: caption is missing (None)")
    if isinstance(caption, (bytes, bytearray, memoryview)):
        caption = bytes(caption).decode("utf-8", errors="replace")
    elif not isinstance(caption, str):
        caption = str(caption)
    if not caption:
        raise BadCaptionError(f"sample {sample_id}: caption is empty")
    if caption.isspace():
        raise BadCaptionError(f"sample {sample_id}: caption is whitespace only")
    return caption


def describe_error(err: BaseException, fallback_id: str) -> BadSampleInfo:
    """Split a vlfit sample error into ``(sample id, reason)``.

    vlfit's sample errors (``DecodeError``, ``BadRecordError``, ``BadCaptionError``) all read
    ``"sample <id>: <reason>"``; anything else is attributed to ``fallback_id`` with its whole message.
    """
    message = str(err)
    if message.startswith("sample ") and ": " in message:
        sample_id, reason = message[len("sample ") :].split(": ", 1)
        return sample_id, reason
    return fallback_id, message or type(err).__name__


def substitute_index(index: int, attempt: int, length: int) -> int:
    """A deterministic stand-in for ``index`` (``attempt`` >= 1), never ``index`` itself when ``length`` > 1.

    A hash of ``(index, attempt)`` rather than ``index + 1``: under sequential sampling the next sample is often
    already in the same batch, and a duplicated pair is a false negative for a contrastive loss. Deterministic,
    so a resumed run and every worker substitute exactly what the uninterrupted run did.
    """
    if length <= 1:
        return 0
    mixed = _splitmix64((index << 8) ^ attempt)
    return (index + 1 + mixed % (length - 1)) % length


def _splitmix64(value: int) -> int:
    mask = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)


def min_samples_for_fraction(max_bad_fraction: float) -> int:
    """How many samples must have been read before ``max_bad_fraction`` is enforced."""
    if max_bad_fraction <= 0:
        return 1  # zero tolerance: the first bad sample is already too many
    return max(MIN_SAMPLES_FOR_BAD_FRACTION, math.ceil(1.0 / max_bad_fraction))


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
    stage: str = "worker"


class BadSampleLedger:
    """Counts samples read and bad samples skipped during a run, and enforces ``--max_bad_fraction``.

    Args:
        max_bad_fraction: Largest tolerated share of bad samples among those read (1.0: never abort).
    """

    def __init__(self, max_bad_fraction: float = 1.0) -> None:
        self.max_bad_fraction = max_bad_fraction
        self.samples_read = 0
        self.records: list[BadSampleRecord] = []

    @property
    def count(self) -> int:
        """Number of bad samples so far."""
        return len(self.records)

    @property
    def fraction(self) -> float:
        """Bad samples over samples read (0 before anything was read)."""
        return self.count / self.samples_read if self.samples_read else 0.0

    def add(self, bad: Iterable[BadSampleInfo], *, rows: int, step: int, stage: str = "worker") -> list[BadSampleInfo]:
        """Record one batch's bad samples.

        Args:
            bad: ``(id, reason)`` pairs.
            rows: Samples the batch delivered. Worker-stage bad samples were read in addition to these (each was
                replaced), device-stage ones are among them (each was dropped), so only the former add to the
                number read.
            step: The optimizer step the batch belongs to.
            stage: ``worker`` or ``device``.

        Returns:
            The pairs recorded (for logging).
        """
        pairs = [(str(sample_id), str(reason)) for sample_id, reason in bad]
        self.samples_read += rows + (len(pairs) if stage == "worker" else 0)
        self.records.extend(BadSampleRecord(sample_id, reason, step, stage) for sample_id, reason in pairs)
        return pairs

    def check(self) -> None:
        """Raise ``TooManyBadSamplesError`` when the bad fraction is over the limit (once enough were read)."""
        if self.max_bad_fraction >= 1.0 or not self.records:
            return
        if self.samples_read < min_samples_for_fraction(self.max_bad_fraction):
            return
        if self.fraction > self.max_bad_fraction:
            first = "; ".join(f"{r.id} ({r.reason})" for r in self.records[:3])
            raise TooManyBadSamplesError(
                f"{self.count} of the {self.samples_read} samples read so far were bad ({self.fraction:.1%}), over "
                f"--max_bad_fraction {self.max_bad_fraction:g}. First ones: {first}. Every skipped id and reason is "
                f"in {BAD_SAMPLES_REPORT} in the output folder: fix or filter the data, or raise --max_bad_fraction."
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
        with open(os.path.join(folder, _checkpoint_file(process_index)), "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f)

    def load(self, folder: str, process_index: int = 0) -> bool:
        """Restore the snapshot a checkpoint holds; False (and nothing changed) when it holds none."""
        path = os.path.join(folder, _checkpoint_file(process_index))
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))
        return True

    def write_report(self, path: str) -> None:
        """Write one JSON line per bad sample to ``path`` (replaced atomically)."""
        temp = f"{path}.tmp"
        with open(temp, "w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
        os.replace(temp, path)


def _checkpoint_file(process_index: int) -> str:
    if process_index == 0:
        return BAD_SAMPLES_CHECKPOINT_FILE
    stem, ext = os.path.splitext(BAD_SAMPLES_CHECKPOINT_FILE)
    return f"{stem}_{process_index}{ext}"
