"""Map-style torch dataset over a source, and the collate function that builds uint8 batches and tokenizes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from vlfit.data.image_transforms import EncodedImage, FastImageTransform, PassThroughEncoded, ReferenceImageTransform
from vlfit.data.sources import ImageTextSource

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
    """Turns source records into ``{"image", "caption", "id"}`` samples by running the image transform.

    Decoding happens here, in the DataLoader worker that asks for the sample. Each worker limits torch to one
    thread: N workers on N cores is the parallelism, and intra-op threads would only oversubscribe the cores.
    """

    def __init__(self, source: ImageTextSource, image_transform: ImageTransform) -> None:
        self.source = source
        self.image_transform = image_transform
        self._threads_set_in: int | None = None

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self._limit_worker_threads()
        record = self.source[index]
        return {
            "image": self.image_transform(record.image, record.id),
            "caption": record.caption,
            "id": record.id,
            **record.extra,
        }

    def _limit_worker_threads(self) -> None:
        info = get_worker_info()
        if info is not None and self._threads_set_in != info.id:
            torch.set_num_threads(1)
            self._threads_set_in = info.id


class ImageTextCollator:
    """Stacks images into one ``[B, 3, H, W]`` tensor (uint8 or float) and tokenizes captions in one call.

    Captions are padded to the longest in the batch (to a multiple of 8 when ``max_seq_length`` is one), not to
    ``max_seq_length``: shorter sequences are cheaper for every layer.

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
            batch["pixel_values"] = torch.stack(images)
        batch["sample_ids"] = [sample["id"] for sample in samples]
        for column in self.keep_columns:
            batch[column] = [sample.get(column) for sample in samples]
        return batch
