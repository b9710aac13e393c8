"""Map-style torch dataset over a source (decoding happens here, in the worker), and the collator that builds a
``Batch``: uint8 (or float) pixels batched, captions tokenized in one call."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from vlfit.data.bad_samples import (
    MAX_SUBSTITUTE_ATTEMPTS,
    RAISE_HINT,
    BadCaptionError,
    BadSampleError,
    check_bad_sample_policy,
    clean_caption,
    describe_error,
    substitute_index,
)
from vlfit.data.batch import BadSample, Batch
from vlfit.data.decode import DecodeError
from vlfit.data.hard_negatives import alternative_captions, caption_choice, tokenize_alternatives
from vlfit.data.image_transforms import EncodedImage, stack_images
from vlfit.data.naflex import PatchImage, collate_patches
from vlfit.data.records import CAPTION_CHOICE, BadRecordError, Record
from vlfit.models.family import IMAGE_KEYS, tokenize_captions

ImageTransform = Callable[[bytes, str], "torch.Tensor | EncodedImage | PatchImage"]
"""bytes and sample id -> the image a sample carries (pixels, NaFlex patches, or ``EncodedImage`` for device
decode)."""


@dataclass
class Sample:
    """One sample as a worker makes it, before collation.

    Attributes:
        id: The sample's id.
        position: The dataset index asked for (a substitute keeps the index it stands in for).
        image: Pixels or encoded bytes; None for the placeholder of a bad sample left out (evaluation).
        caption: The caption text (None for a placeholder).
        columns: Extra columns of the record (``caption_choices``, ``label``).
        bad_samples: Bad samples met while making this one (the sample itself, for a placeholder).
        image_key: ``Record.image_key`` (None for a placeholder).
        stream_positions: From a stream (``vlfit.data.stream.dataset``): the positions of the stream items this
            sample was made from, for ``ShardStream.mark_consumed``; empty for a map-style source.
    """

    id: str
    position: int
    image: torch.Tensor | EncodedImage | PatchImage | None
    caption: str | None
    columns: dict[str, Any] = field(default_factory=dict)
    bad_samples: list[BadSample] = field(default_factory=list)
    image_key: int | None = None
    stream_positions: list[Any] = field(default_factory=list)


_set_up_in: int | None = None  # the process set_up_loader_worker last ran in


def set_up_loader_worker() -> None:
    """Once per DataLoader worker process: one torch thread, and a session of its own.

    Ctrl-C in a terminal, and ``kill`` of a process group, signal every process of the group. The main process
    then saves a checkpoint at the end of the step (``vlfit.training.preemption``), which may still need batches;
    a worker killed by the signal would instead make torch abort the main process mid-step. Leaving the group
    (rather than ignoring the signals) keeps signals sent to the worker's own pid working: torch and
    multiprocessing stop stuck workers with SIGTERM, and an ignored SIGTERM hangs their join.
    """
    global _set_up_in
    if get_worker_info() is None or _set_up_in == os.getpid():
        return
    torch.set_num_threads(1)
    if multiprocessing.parent_process() is not None:  # a worker process, not a main process calling us
        with contextlib.suppress(OSError):  # already a session leader: nothing to leave
            os.setsid()
    _set_up_in = os.getpid()


def record_sample(
    record: Record, image_transform: ImageTransform, position: int, out: torch.Tensor | None = None
) -> Sample:
    """The ``Sample`` of one record: its caption checked, its image through ``image_transform`` (into ``out``, a
    row of the batch's tensor, when given).

    Raises:
        BadCaptionError, DecodeError: for a missing caption or an image that does not decode.
    """
    # The caption is checked first: it is free, and a bad one makes decoding the image pointless.
    caption = clean_caption(record.caption, record.id)
    if out is None:
        image = image_transform(record.image, record.id)
    else:  # into its row of the batch (a substitute takes the row of the bad sample, which wrote nothing)
        image = image_transform(record.image, record.id, out=out)  # type: ignore[call-arg]
    return Sample(
        record.id, position, image=image, caption=caption, columns=dict(record.extra), image_key=record.image_key
    )


class ImageTextDataset(Dataset):
    """Turns source records into ``Sample``s by running the image transform.

    Decoding happens here, in the DataLoader worker that asks for the sample. Each worker limits torch to one
    thread: N workers on N cores is the parallelism, and intra-op threads would only oversubscribe the cores.

    Bad samples (unreadable record, undecodable image, missing/empty/whitespace caption; see
    ``vlfit.data.bad_samples``) follow ``bad_sample_policy``:

    - ``skip`` with ``substitute=True`` (training): the sample at ``substitute_index(index, 1)`` (then 2, ...) is
      returned instead, so batches keep their size, and every bad sample skipped on the way is listed in the
      returned sample's ``bad_samples``.
    - ``skip`` with ``substitute=False`` (evaluation: metrics over the valid pairs only, no duplicates): a
      placeholder with ``image=None`` listing the sample in ``bad_samples``; the collator leaves it out.
    - ``raise``: ``BadSampleError`` naming the sample and the reason.

    The DataLoader asks for a batch's samples at once (``__getitems__``). With a transform that can write into a
    batch (``FastImageTransform.new_batch``), each image is then resized straight into its row of one uint8 batch
    tensor, in shared memory in a loader worker: the collator takes that tensor as the batch's pixels, so no image
    is copied again on its way to the main process.

    Args:
        source: The records: a map-style source (``vlfit.data.sources``), read by length and index.
        image_transform: bytes -> model input (or ``EncodedImage`` for device decode).
        bad_sample_policy: ``skip`` or ``raise``.
        substitute: Replace skipped samples (``True``) or return placeholders (``False``).
    """

    def __init__(
        self,
        source: Sequence[Record],
        image_transform: ImageTransform,
        bad_sample_policy: str = "skip",
        substitute: bool = True,
    ) -> None:
        check_bad_sample_policy(bad_sample_policy)
        self.source = source
        self.image_transform = image_transform
        self.bad_sample_policy = bad_sample_policy
        self.substitute = substitute

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Sample:
        self._set_up_worker()
        return self._sample(index)

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """The samples at ``indices``, their images written into the rows of one batch where the transform can."""
        self._set_up_worker()
        new_batch = getattr(self.image_transform, "new_batch", None)
        if new_batch is None:
            return [self._sample(index) for index in indices]
        rows = new_batch(len(indices), shared=get_worker_info() is not None)
        return [self._sample(index, out=rows[i]) for i, index in enumerate(indices)]

    def _sample(self, index: int, out: torch.Tensor | None = None) -> Sample:
        skipped: list[BadSample] = []
        position = index
        for attempt in range(MAX_SUBSTITUTE_ATTEMPTS + 1):
            if attempt:
                position = substitute_index(index, attempt, len(self))
            try:
                sample = self._load(position, out)
            except (BadRecordError, DecodeError, BadCaptionError) as err:
                sample_id, reason = describe_error(err, fallback_id=f"row {position}")
                if self.bad_sample_policy == "raise":
                    raise BadSampleError.for_sample(sample_id, reason, RAISE_HINT) from err
                skipped.append(BadSample(sample_id, reason))
                if not self.substitute:
                    return Sample(sample_id, index, image=None, caption=None, bad_samples=skipped)
                continue
            sample.position = index  # the row asked for (evaluation merges processes' results by it)
            sample.bad_samples = skipped
            return sample
        raise BadSampleError.for_sample(
            skipped[0].id,
            f"{skipped[0].reason}; and the {MAX_SUBSTITUTE_ATTEMPTS} substitutes tried for it were bad too "
            f"({'; '.join(f'{b.id}: {b.reason}' for b in skipped[1:4])}, ...): the data looks mostly unreadable",
        )

    def _load(self, position: int, out: torch.Tensor | None) -> Sample:
        return record_sample(self.source[position], self.image_transform, position, out)

    def _set_up_worker(self) -> None:
        set_up_loader_worker()


class ImageTextCollator:
    """Batches images into one ``[B, 3, H, W]`` tensor (uint8 or float; the dataset's batch tensor itself when the
    images are its rows), tokenizes captions in one call, and returns a ``Batch``.

    Captions are padded to the longest in the batch (to a multiple of 8 when ``max_seq_length`` is one), not to
    ``max_seq_length``: shorter sequences are cheaper for every layer. Placeholders of bad samples (``image`` None)
    are left out; every bad sample met while making the batch is listed in ``Batch.bad_samples``. Each row's
    ``Record.image_key`` goes along as the ``image_keys`` input: the loss and the evaluation know the captions of
    one image by it.

    With ``hard_negative_column``, each row's alternative captions (that column's choices other than its own; see
    ``vlfit.data.hard_negatives``) are tokenized too, as the ``hard_negative_*`` inputs.

    Args:
        tokenizer: A transformers tokenizer.
        max_seq_length: Truncation length.
        keep_columns: Extra record columns to carry as per-row lists (for evaluation).
        hard_negative_column: The record column of alternative captions (among the record's extra columns), or
            ``None`` for no hard negatives.
        label_column: The record column naming the right choice of ``hard_negative_column``, when there is one.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_seq_length: int,
        keep_columns: Sequence[str] = (),
        hard_negative_column: str | None = None,
        label_column: str = "label",
    ) -> None:
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.keep_columns = tuple(keep_columns)
        self.hard_negative_column = hard_negative_column
        self.label_column = label_column

    def __call__(self, samples: list[Sample]) -> Batch:
        bad_samples = [bad for sample in samples for bad in sample.bad_samples]
        stream_positions = [position for sample in samples for position in sample.stream_positions]
        samples = [sample for sample in samples if sample.image is not None]
        if not samples:
            return Batch.empty(bad_samples, stream_positions)
        text = tokenize_captions(
            self.tokenizer, [sample.caption or "" for sample in samples], self.max_seq_length, multiple_of_8=True
        )
        inputs = {
            "input_ids": text["input_ids"],
            "attention_mask": text["attention_mask"],
            IMAGE_KEYS: torch.tensor([sample.image_key for sample in samples], dtype=torch.long),
        }
        if self.hard_negative_column is not None:
            inputs.update(self._hard_negatives(samples))
        images = [sample.image for sample in samples]
        encoded = None
        if isinstance(images[0], EncodedImage):
            encoded = images
        elif isinstance(images[0], PatchImage):  # NaFlex: padded to the batch's longest, with mask and grids
            inputs.update(collate_patches(images, shared=get_worker_info() is not None))  # type: ignore[arg-type]
        else:
            inputs["pixel_values"] = stack_images(images)
        return Batch(
            inputs=inputs,
            sample_ids=[sample.id for sample in samples],
            positions=[sample.position for sample in samples],
            bad_samples=bad_samples,
            encoded_images=encoded,  # type: ignore[arg-type]
            columns=self._columns(samples),
            stream_positions=stream_positions,
        )

    def _columns(self, samples: list[Sample]) -> dict[str, list[Any]]:
        """The kept columns per row, and with ``caption_choices`` each row's ``CAPTION_CHOICE``. A row without
        ``caption_choices`` takes its ``hard_negative_column`` alternatives as its choices: matching is evaluated on
        the column training took its hard negatives from."""
        columns = {name: [sample.columns.get(name) for sample in samples] for name in self.keep_columns}
        if "caption_choices" in columns and self.hard_negative_column not in (None, "caption_choices"):
            columns["caption_choices"] = [
                sample.columns.get(self.hard_negative_column) if choices is None else choices
                for choices, sample in zip(columns["caption_choices"], samples, strict=True)
            ]
        if "caption_choices" in columns:
            columns[CAPTION_CHOICE] = [
                caption_choice(choices, sample.caption or "")
                for choices, sample in zip(columns["caption_choices"], samples, strict=True)
            ]
        return columns

    def _hard_negatives(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        column = self.hard_negative_column
        alternatives = [
            alternative_captions(
                sample.columns.get(column),  # type: ignore[arg-type]
                sample.caption or "",
                label=sample.columns.get(self.label_column),
                column=column,  # type: ignore[arg-type]
                sample_id=sample.id,
            )
            for sample in samples
        ]
        return tokenize_alternatives(self.tokenizer, alternatives, self.max_seq_length)
