"""Bad samples: what counts as one, what ``--bad_sample_policy`` does with it, and the run's ledger of them.

A sample is bad when its record cannot be read (``BadRecordError``), its image cannot be decoded (``DecodeError``:
corrupt or truncated data, an unknown format, a decompression bomb) or its caption is missing, empty or only
whitespace. Captions are never bad for their bytes: invalid UTF-8 is decoded with U+FFFD replacement characters
(one mis-encoded accent should not cost the whole pair), and over-long captions are truncated by the tokenizer.

Policies:

- ``skip`` (default): the dataset replaces the bad sample by a deterministic substitute (``substitute_index``),
  so training batches keep their size, and reports it in the batch's ``bad_samples``; the training run counts
  them in its logs, metrics and ``bad_samples.jsonl`` (``vlfit.training.bad_sample_ledger``).
- ``raise``: the first bad sample stops the run with ``BadSampleError`` naming the sample and the reason.

``--max_bad_fraction`` bounds ``skip`` (judged by the training run's ledger once ``MIN_SAMPLES_FOR_BAD_FRACTION``
samples were read, so a single bad sample early in a run never reads as a high rate).
"""

from __future__ import annotations

from typing import Any

from vlfit.errors import ConfigError, DataError

BAD_SAMPLE_POLICIES: tuple[str, ...] = ("skip", "raise")
# The fraction is judged only after at least this many samples were read (and at least 1/max_bad_fraction, so
# that one bad sample alone can never exceed the limit): small samples give noisy rates.
MIN_SAMPLES_FOR_BAD_FRACTION = 100
# The report every command that skips bad samples writes into its output folder: one JSON line per bad sample.
BAD_SAMPLES_REPORT = "bad_samples.jsonl"
# How many substitutes ``skip`` tries for one index before concluding the data is mostly unreadable.
MAX_SUBSTITUTE_ATTEMPTS = 16

# What ``--bad_sample_policy raise`` tells the user to do.
RAISE_HINT = (
    "--bad_sample_policy raise stops at the first bad sample: remove or fix this sample, or pass "
    "--bad_sample_policy skip to replace bad samples and count them"
)


def check_bad_sample_policy(policy: str) -> None:
    """Raises ``ConfigError`` unless ``policy`` is one of ``BAD_SAMPLE_POLICIES``."""
    if policy not in BAD_SAMPLE_POLICIES:
        raise ConfigError(f"unknown --bad_sample_policy {policy!r}; choose one of: {', '.join(BAD_SAMPLE_POLICIES)}")


BadSampleInfo = tuple[str, str]
"""``(sample id, reason)``."""


class BadSampleError(DataError):
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


class BadCaptionError(DataError):
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
