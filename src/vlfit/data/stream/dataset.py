"""A shard stream as the input pipeline's dataset: records from ``vlfit.data.stream.ShardStream``, decoded in the
loader worker by the same image transform and bad-sample rules as ``ImageTextDataset``, into ``Sample``s.

A stream has no index to substitute from: a bad sample (an image that does not decode, a missing caption) is
left out and the next one taken, so batches keep their size. What it skipped goes along with the next sample: its
``bad_samples`` (for the run's ledger and ``--max_bad_fraction``), and the stream positions of every item it was
made from (``Sample.stream_positions``), which the consumer hands to ``ShardStream.mark_consumed`` (each item's
position is its reader's state after it: that is what an exact resume is taken from). A shard given up after its
retries is one bad sample named by its URL. When a reader's last items were bad, a placeholder (``image`` None)
carries them; the collator leaves it out of the rows but keeps what it carries.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from vlfit.data.bad_samples import (
    RAISE_HINT,
    BadCaptionError,
    BadSampleError,
    check_bad_sample_policy,
    describe_error,
)
from vlfit.data.batch import BadSample
from vlfit.data.dataset import ImageTransform, Sample, record_sample, set_up_loader_worker
from vlfit.data.decode import DecodeError
from vlfit.data.records import BadRecordError
from vlfit.data.stream import ShardStream, StreamItem


def _reported(item: StreamItem) -> list[BadSample]:
    """What a stream item's reader reports since its previous item: samples without a record, shards given up."""
    position = item.position
    bad = [BadSample(sample_id, reason) for sample_id, reason in position.bad_samples]
    bad += [
        BadSample(shard.url, f"shard given up after {shard.samples_read} samples: {shard.reason}")
        for shard in position.bad_shards
    ]
    return bad


class StreamingImageTextDataset(IterableDataset):
    """``Sample``s from a ``ShardStream`` (see the module's docstring).

    Args:
        stream: The records, split over ranks and workers by the stream itself.
        image_transform: bytes -> model input (the pipeline's, as for a map-style source).
        bad_sample_policy: ``skip`` (left out, counted) or ``raise`` (``BadSampleError`` at the first).
    """

    def __init__(self, stream: ShardStream, image_transform: ImageTransform, bad_sample_policy: str = "skip") -> None:
        check_bad_sample_policy(bad_sample_policy)
        self.stream = stream
        self.image_transform = image_transform
        self.bad_sample_policy = bad_sample_policy

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Sample]:
        set_up_loader_worker()
        skipped: list[BadSample] = []
        positions: list[Any] = []
        for item in self.stream:
            positions.append(item.position)
            skipped += _reported(item)
            if item.record is None:
                continue
            try:
                sample = record_sample(item.record, self.image_transform, -1)
            except (BadRecordError, DecodeError, BadCaptionError) as err:
                sample_id, reason = describe_error(err, fallback_id=item.record.id)
                if self.bad_sample_policy == "raise":
                    raise BadSampleError.for_sample(sample_id, reason, RAISE_HINT) from err
                skipped.append(BadSample(sample_id, reason))
                continue
            self._check_raise(skipped)
            sample.bad_samples, sample.stream_positions = skipped, positions
            yield sample
            skipped, positions = [], []
        if positions:
            self._check_raise(skipped)
            yield Sample("", -1, image=None, caption=None, bad_samples=skipped, stream_positions=positions)

    def _check_raise(self, skipped: list[BadSample]) -> None:
        if skipped and self.bad_sample_policy == "raise":
            raise BadSampleError.for_sample(skipped[0].id, skipped[0].reason, RAISE_HINT)


__all__ = ["StreamingImageTextDataset"]
