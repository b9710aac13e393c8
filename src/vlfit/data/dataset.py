"""Map-style torch dataset over a source, and the collate function that builds uint8 batches and tokenizes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, get_worker_info

from vlfit.data.bad_samples import (
    BAD_SAMPLE_POLICIES,
    MAX_SUBSTITUTE_ATTEMPTS,
    RAISE_HINT,
    BadCaptionError,
    BadSampleError,
    BadSampleInfo,
    clean_caption,
    describe_error,
    substitute_index,
)
from vlfit.data.decode import DecodeError
from vlfit.data.image_transforms import (
    EncodedImage,
    FastImageTransform,
    PassThroughEncoded,
    ReferenceImageTransform,
    stack_images,
)
from vlfit.data.records import BadRecordError

if TYPE_CHECKING:  # sources need the datasets package; the loader itself does not (vlfit bench on a bare GPU box)
    from vlfit.data.source_base import ImageTextSource

ImageTransform = Callable[[bytes, str], "torch.Tensor | EncodedImage"]


def build_image_transform(
    pipeline: str,
    *,
    image_size: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    decode_on_device: bool = False,
    random_resized_crop: bool = False,
) -> ImageTransform:
    """The worker-side image transform for ``--image_pipeline`` (``fast`` or ``reference``) or device decode."""
    if decode_on_device:
        return PassThroughEncoded()
    if pipeline == "fast":
        return FastImageTransform(image_size, random_resized_crop=random_resized_crop)
    if pipeline == "reference":
        if random_resized_crop:
            raise ValueError("--random_resized_crop is a fast-pipeline option; the reference pipeline has none")
        return ReferenceImageTransform(image_size, mean, std)
    raise ValueError(f"unknown --image_pipeline {pipeline!r}; choose one of: fast, reference")


class ImageTextDataset(Dataset):
    """Turns source records into ``{"image", "caption", "id", "position", "bad_samples"}`` samples by running the
    transform (``position`` is the index asked for).

    Decoding happens here, in the DataLoader worker that asks for the sample. Each worker limits torch to one
    thread: N workers on N cores is the parallelism, and intra-op threads would only oversubscribe the cores.

    Bad samples (unreadable record, undecodable image, missing/empty/whitespace caption; see
    ``vlfit.data.bad_samples``) follow ``bad_sample_policy``:

    - ``skip`` with ``substitute=True`` (training): the sample at ``substitute_index(index, 1)`` (then 2, ...) is
      returned instead, so batches keep their size, and every ``(id, reason)`` skipped on the way is listed in the
      returned sample's ``bad_samples``.
    - ``skip`` with ``substitute=False`` (evaluation: metrics over the valid pairs only, no duplicates): a
      placeholder with ``image=None`` and the ``(id, reason)`` in ``bad_samples``; the collator leaves it out.
    - ``raise``: ``BadSampleError`` naming the sample and the reason.

    Args:
        source: The records.
        image_transform: bytes -> model input (or ``EncodedImage`` for device decode).
        bad_sample_policy: ``skip`` or ``raise``.
        substitute: Replace skipped samples (``True``) or return placeholders (``False``).
    """

    def __init__(
        self,
        source: ImageTextSource,
        image_transform: ImageTransform,
        bad_sample_policy: str = "skip",
        substitute: bool = True,
    ) -> None:
        if bad_sample_policy not in BAD_SAMPLE_POLICIES:
            raise ValueError(
                f"unknown bad_sample_policy {bad_sample_policy!r}; choose one of: {', '.join(BAD_SAMPLE_POLICIES)}"
            )
        self.source = source
        self.image_transform = image_transform
        self.bad_sample_policy = bad_sample_policy
        self.substitute = substitute
        self._worker_set_up: int | None = None

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self._set_up_worker()
        skipped: list[BadSampleInfo] = []
        position = index
        for attempt in range(MAX_SUBSTITUTE_ATTEMPTS + 1):
            if attempt:
                position = substitute_index(index, attempt, len(self))
            try:
                sample = self._load(position)
            except (BadRecordError, DecodeError, BadCaptionError) as err:
                sample_id, reason = describe_error(err, fallback_id=f"row {position}")
                if self.bad_sample_policy == "raise":
                    raise BadSampleError.for_sample(sample_id, reason, RAISE_HINT) from err
                skipped.append((sample_id, reason))
                if not self.substitute:
                    return {"id": sample_id, "image": None, "caption": None, "bad_samples": skipped}
                continue
            sample["bad_samples"] = skipped
            sample["position"] = index  # the row asked for (evaluation merges processes' results by it)
            return sample
        raise BadSampleError.for_sample(
            skipped[0][0],
            f"{skipped[0][1]}; and the {MAX_SUBSTITUTE_ATTEMPTS} substitutes tried for it were bad too "
            f"({'; '.join(f'{i}: {r}' for i, r in skipped[1:4])}, ...): the data looks mostly unreadable",
        )

    def _load(self, position: int) -> dict[str, Any]:
        record = self.source[position]
        # The caption is checked first: it is free, and a bad one makes decoding the image pointless.
        caption = clean_caption(record.caption, record.id)
        return {
            "image": self.image_transform(record.image, record.id),
            "caption": caption,
            "id": record.id,
            **record.extra,
        }

    def _set_up_worker(self) -> None:
        """Once per DataLoader worker process: one torch thread, and a session of its own.

        Ctrl-C in a terminal, and ``kill`` of a process group, signal every process of the group. The main
        process then saves a checkpoint at the end of the step (``vlfit.training.preemption``), which may still
        need batches; a worker killed by the signal would instead make torch abort the main process mid-step.
        Leaving the group (rather than ignoring the signals) keeps signals sent to the worker's own pid working:
        torch and multiprocessing stop stuck workers with SIGTERM, and an ignored SIGTERM hangs their join.
        """
        info = get_worker_info()
        if info is not None and self._worker_set_up != info.id:
            torch.set_num_threads(1)
            if multiprocessing.parent_process() is not None:  # a worker process, not a main process calling us
                with contextlib.suppress(OSError):  # already a session leader: nothing to leave
                    os.setsid()
            self._worker_set_up = info.id


class ImageTextCollator:
    """Stacks images into one ``[B, 3, H, W]`` tensor (uint8 or float) and tokenizes captions in one call.

    Captions are padded to the longest in the batch (to a multiple of 8 when ``max_seq_length`` is one), not to
    ``max_seq_length``: shorter sequences are cheaper for every layer.

    ``batch["bad_samples"]`` lists the ``(id, reason)`` of every sample skipped while making the batch (the trainer
    counts them); placeholders of skipped samples (``image`` None) are left out of the batch.

    Args:
        tokenizer: A transformers tokenizer.
        max_seq_length: Truncation length.
        keep_columns: Extra sample keys to pass through as lists (for evaluation).
    """

    def __init__(self, tokenizer: Any, max_seq_length: int, keep_columns: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.keep_columns = tuple(keep_columns)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        bad_samples = [pair for sample in samples for pair in sample.get("bad_samples", ())]
        # Placeholders of skipped samples (evaluation datasets, which do not substitute) are left out.
        samples = [sample for sample in samples if sample["image"] is not None]
        if not samples:
            return {"sample_ids": [], "bad_samples": bad_samples}
        captions = [sample["caption"] or "" for sample in samples]
        text = self.tokenizer(
            captions,
            max_length=self.max_seq_length,
            truncation=True,
            padding="longest",
            # transformers refuses a truncation length that is not a multiple of pad_to_multiple_of.
            pad_to_multiple_of=8 if self.max_seq_length % 8 == 0 else None,
            return_tensors="pt",
        )
        batch: dict[str, Any] = {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"]}
        images = [sample["image"] for sample in samples]
        if isinstance(images[0], EncodedImage):
            batch["encoded_images"] = images
        else:
            batch["pixel_values"] = stack_images(images)
        batch["sample_ids"] = [sample["id"] for sample in samples]
        if all("position" in sample for sample in samples):  # ImageTextDataset's samples (evaluation needs them)
            batch["positions"] = [sample["position"] for sample in samples]
        batch["bad_samples"] = bad_samples
        for column in self.keep_columns:
            batch[column] = [sample.get(column) for sample in samples]
        return batch
