"""Per-batch device stage: runs on the training device after the host-to-device copy.

uint8 -> float, normalize with the model's mean and std, random horizontal flip, and (with ``--decode_on_device``)
JPEG decode with nvJPEG plus resize and crop. The functions are device-agnostic: the same code runs on CPU
tensors in tests and on CUDA tensors in training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torchvision

from vlfit.data.decode import decode_scaled, is_jpeg, jpeg_exif_orientation
from vlfit.data.image_transforms import EncodedImage, hwc_to_chw_view, resize_crop_uint8

logger = logging.getLogger(__name__)


def normalize_uint8(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(pixels / 255 - mean) / std`` as one fused multiply-add, in ``dtype``.

    Args:
        pixels: uint8 ``[B, 3, H, W]``.
        mean: ``[3]`` float on the same device.
        std: ``[3]`` float on the same device.
        dtype: Output dtype (the model's).
    """
    scale = (1.0 / (255.0 * std)).view(1, -1, 1, 1)
    shift = (-mean / std).view(1, -1, 1, 1)
    return torch.addcmul(shift, pixels.float(), scale).to(dtype)


def random_horizontal_flip(pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each image of ``[B, C, H, W]`` left-right with probability 1/2."""
    flip = torch.rand(pixels.shape[0], generator=generator, device="cpu") < 0.5
    flip = flip.to(pixels.device).view(-1, 1, 1, 1)
    return torch.where(flip, pixels.flip(-1), pixels)


def decode_resize_batch(images: list[EncodedImage], size: int, device: torch.device | str) -> torch.Tensor:
    """Decode a batch of encoded images on ``device`` and resize/crop each to ``size x size`` (uint8).

    JPEGs are decoded together by ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA). Samples it refuses (PNG, WebP,
    CMYK JPEG, corrupt data) fall back to the CPU decoder one by one, so one odd file never fails the batch.
    EXIF orientation is applied on both paths.

    Returns:
        uint8 ``[B, 3, size, size]`` on ``device``.
    """
    device = torch.device(device)
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    jpeg_index = [i for i, image in enumerate(images) if is_jpeg(image.data)]
    decoded: dict[int, torch.Tensor] = {}
    if jpeg_index:
        tensors = [images[i].tensor() for i in jpeg_index]
        try:
            results = torchvision.io.decode_jpeg(tensors, mode=torchvision.io.ImageReadMode.RGB, device=device)
            if device.type == "cuda":
                # decode_jpeg runs on an internal stream: wait for it before any kernel reads the outputs.
                torch.cuda.synchronize(device)
            decoded = dict(zip(jpeg_index, results, strict=True))
        except RuntimeError:
            # One bad JPEG fails the batched call; decode individually to find which ones to send to the CPU.
            for i, tensor in zip(jpeg_index, tensors, strict=True):
                try:
                    decoded[i] = torchvision.io.decode_jpeg(
                        tensor, mode=torchvision.io.ImageReadMode.RGB, device=device
                    )
                except RuntimeError:
                    continue
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    for i, image in enumerate(images):
        if i in decoded:
            pixels = _orient_chw(decoded[i], jpeg_exif_orientation(image.data))
        else:
            pixels = hwc_to_chw_view(decode_scaled(image.data, size, image.sample_id)).to(device)
        out[i] = resize_crop_uint8(pixels, size)
    return out


def _orient_chw(pixels: torch.Tensor, orientation: int) -> torch.Tensor:
    if orientation == 1:
        return pixels
    # The same transposes as decode.apply_orientation, on an HWC view of the tensor.
    hwc = pixels.permute(1, 2, 0)
    if orientation == 2:
        hwc = hwc.flip(1)
    elif orientation == 3:
        hwc = hwc.flip(0).flip(1)
    elif orientation == 4:
        hwc = hwc.flip(0)
    elif orientation == 5:
        hwc = hwc.transpose(0, 1)
    elif orientation == 6:
        hwc = torch.rot90(hwc, k=-1, dims=(0, 1))
    elif orientation == 7:
        hwc = torch.rot90(hwc, k=-1, dims=(0, 1)).flip(0)
    elif orientation == 8:
        hwc = torch.rot90(hwc, k=1, dims=(0, 1))
    return hwc.permute(2, 0, 1)


class DeviceStage:
    """Turns a collated batch into model inputs on ``device``.

    Args:
        image_size: Model input side (used by device decode).
        mean: Normalization mean (the model's image processor's).
        std: Normalization std.
        horizontal_flip: Randomly flip images (training only).
    """

    def __init__(
        self,
        image_size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        horizontal_flip: bool = False,
    ) -> None:
        self.image_size = image_size
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.horizontal_flip = horizontal_flip
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _stats_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._stats:
            self._stats[device] = (self.mean.to(device), self.std.to(device))
        return self._stats[device]

    def __call__(
        self, batch: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.float32, train: bool = True
    ) -> dict[str, Any]:
        """Return a new batch whose ``pixel_values`` are normalized ``dtype`` on ``device``."""
        batch = {
            key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()
        }
        if "encoded_images" in batch:
            pixels = decode_resize_batch(batch.pop("encoded_images"), self.image_size, device)
        else:
            pixels = batch["pixel_values"]
        if pixels.dtype == torch.uint8:
            mean, std = self._stats_on(pixels.device)
            pixels = normalize_uint8(pixels, mean, std, dtype)
        else:
            pixels = pixels.to(dtype)
        if train and self.horizontal_flip:
            pixels = random_horizontal_flip(pixels)
        batch["pixel_values"] = pixels
        return batch


class CudaPrefetcher:
    """Runs the device stage of batch ``i + 1`` on a side stream while the model computes on batch ``i``.

    The idea of timm's PrefetchLoader: the copy and the normalization overlap compute, and the compute stream
    waits for the side stream only when it takes the batch.
    """

    def __init__(self, batches: Iterator[dict[str, Any]], stage: DeviceStage, device: torch.device, dtype) -> None:
        self.batches = batches
        self.stage = stage
        self.device = device
        self.dtype = dtype
        self.stream = torch.cuda.Stream(device=device)
        self._next: dict[str, Any] | None = None
        self._exhausted = False
        self._preload()

    def _preload(self) -> None:
        try:
            batch = next(self.batches)
        except StopIteration:
            self._next, self._exhausted = None, True
            return
        # accelerate may already have copied the batch's tensors on the compute stream: order after that copy.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._next = self.stage(batch, self.device, self.dtype)
        self._next["_device_ready"] = True  # the Trainer must not run the stage again

    def __iter__(self) -> CudaPrefetcher:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._exhausted and self._next is None:
            raise StopIteration
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self._next
        assert batch is not None
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                # The tensor was made on the side stream; tell the allocator the compute stream uses it too.
                value.record_stream(torch.cuda.current_stream(self.device))
        self._preload()
        return batch
