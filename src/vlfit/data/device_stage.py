"""Per-batch device stage: the host-to-device copy, then the work on the training device.

The copy (``copy_to_device``: the only place the input pipeline moves a batch), uint8 -> float, normalize with the
model's mean and std, random horizontal flip, and (with ``--decode_on_device``) JPEG decode on the device plus
resize and crop (``vlfit.data.device_decode``). The functions are device-agnostic: the same code runs on CPU
tensors in tests and on CUDA tensors in training. ``CudaPrefetcher`` runs the stage of the next batch, its copy
included, on a side stream while the current one computes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import torch

from vlfit.data.bad_samples import RAISE_HINT, BadSampleError, describe_error
from vlfit.data.batch import DEVICE, BadSample, Batch
from vlfit.data.decode import DecodeError
from vlfit.data.device_decode import decode_resize_batch, decode_resize_batch_skipping_bad
from vlfit.data.normalize import normalize_uint8

logger = logging.getLogger(__name__)


def random_horizontal_flip(pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each image of ``[B, C, H, W]`` left-right with probability 1/2."""
    flip = torch.rand(pixels.shape[0], generator=generator, device="cpu") < 0.5
    flip = flip.to(pixels.device).view(-1, 1, 1, 1)
    return torch.where(flip, pixels.flip(-1), pixels)


class ReusedBuffers:
    """Float buffers of a batch's shape, taken again for later batches once nothing holds them (CPU devices).

    On a CPU device a new batch-sized float tensor (50 MB for 48 images at 294 px) is memory the operating system
    maps in page by page as it is first written, which takes longer than normalizing into it; reused memory is
    mapped already. Each buffer is handed out as a view, so everything that keeps the batch's pixels alive (the
    batch, a view or slice of them, a tensor autograd saved for the backward pass) holds a reference to its
    storage; a buffer is taken again only when its storage has no holder but the buffer itself.

    Args:
        keep: Buffers kept at most (the training loop holds the batch it trains on while the next one is made).
    """

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._buffers: list[torch.Tensor] = []

    def empty(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` whose memory nothing else uses (contents undefined)."""
        for buffer in self._buffers:
            if buffer.shape == shape and buffer.dtype == dtype and _unheld(buffer):
                return buffer.view(shape)
        buffer = torch.empty(shape, dtype=dtype)
        self._buffers = [buffer, *self._buffers][: self.keep]
        return buffer.view(shape)


def _unheld(buffer: torch.Tensor) -> bool:
    # References to the buffer's storage: the buffer's own, and the storage object made for asking.
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2


def copy_to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch with its tensors on ``device``: the input pipeline's one host-to-device copy.

    ``non_blocking``: from pinned memory (the loader pins batches for CUDA) the copy is queued on the current
    stream and returns at once, so on the prefetcher's side stream it overlaps compute. Tensors already on
    ``device`` are not copied; encoded images stay on the host, where the decoders read them.
    """
    return batch.to(device, non_blocking=True)


class DeviceStage:
    """Turns a collated host ``Batch`` into model inputs on ``device``: copies it there, then normalizes it.

    With device decode, a sample whose bytes passed the worker's header check but fail to decode is found only
    here, after the batch was formed, so it cannot be replaced: with ``bad_sample_policy="skip"`` its row is
    dropped from the batch (which shrinks by one) and listed in ``Batch.bad_samples`` with stage ``device``; with
    ``"raise"`` a ``BadSampleError`` names it.

    Args:
        image_size: Model input side (used by device decode).
        mean: Normalization mean (the model's image processor's).
        std: Normalization std.
        horizontal_flip: Randomly flip images (training only).
        bad_sample_policy: ``skip`` or ``raise`` (see ``vlfit.data.bad_samples``).
    """

    def __init__(
        self,
        image_size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        horizontal_flip: bool = False,
        bad_sample_policy: str = "raise",
    ) -> None:
        self.image_size = image_size
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.horizontal_flip = horizontal_flip
        self.bad_sample_policy = bad_sample_policy
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._host_buffers = ReusedBuffers()

    def _stats_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._stats:
            self._stats[device] = (self.mean.to(device), self.std.to(device))
        return self._stats[device]

    def __call__(
        self, batch: Batch, device: torch.device, dtype: torch.dtype = torch.float32, train: bool = True
    ) -> Batch:
        """Return the batch with normalized ``dtype`` pixels on ``device`` (``on_device`` set)."""
        batch = copy_to_device(batch, device)
        if batch.encoded_images is not None:
            batch = self._decode(batch, device)
        pixels = batch.inputs["pixel_values"]
        flip = train and self.horizontal_flip
        if pixels.dtype == torch.uint8 and pixels.dim() == 3:  # NaFlex patches (the pipeline refuses a flip)
            mean, std = self._stats_on(pixels.device)
            pixels = normalize_uint8(pixels, mean, std, dtype, mask=batch.inputs["pixel_attention_mask"])
        elif pixels.dtype == torch.uint8:
            if flip:  # on the uint8 pixels: a quarter of the bytes, and the same result as flipping after
                pixels = random_horizontal_flip(pixels)
            mean, std = self._stats_on(pixels.device)
            # On CUDA the caching allocator reuses memory already; on a CPU device the stage keeps its own.
            out = self._host_buffers.empty(pixels.shape) if pixels.device.type == "cpu" else None
            pixels = normalize_uint8(pixels, mean, std, dtype, out=out)
        else:
            pixels = pixels.to(dtype)
            if flip:
                pixels = random_horizontal_flip(pixels)
        return replace(batch, inputs={**batch.inputs, "pixel_values": pixels}, on_device=True)

    def _decode(self, batch: Batch, device: torch.device) -> Batch:
        images = batch.encoded_images
        assert images is not None
        if self.bad_sample_policy != "skip":
            try:
                pixels = decode_resize_batch(images, self.image_size, device)
            except DecodeError as err:
                sample_id, reason = describe_error(err, "?")
                raise BadSampleError.for_sample(sample_id, reason, RAISE_HINT) from err
            return replace(batch, inputs={**batch.inputs, "pixel_values": pixels}, encoded_images=None)
        pixels, failed = decode_resize_batch_skipping_bad(images, self.image_size, device)
        if failed and len(failed) == len(images):
            raise BadSampleError.for_sample(
                ", ".join(sample_id for _, sample_id, _ in failed),
                f"all {len(images)} images of the batch failed to decode on {device.type} (first: {failed[0][2]}); "
                "the data looks mostly unreadable",
            )
        if failed:
            bad_rows = {i for i, _, _ in failed}
            batch = batch.select([i for i in range(len(images)) if i not in bad_rows])
            dropped = [BadSample(sample_id, reason, DEVICE) for _, sample_id, reason in failed]
            batch = replace(batch, bad_samples=[*batch.bad_samples, *dropped])
        return replace(batch, inputs={**batch.inputs, "pixel_values": pixels}, encoded_images=None)


class CudaPrefetcher:
    """Runs the device stage of batch ``i + 1`` on a side stream while the model computes on batch ``i``.

    The idea of timm's PrefetchLoader: the host-to-device copy (non-blocking, from the pinned host batch the loader
    made) and the normalization overlap compute, and the compute stream waits for the side stream only when it
    takes the batch. The tensors made on the side stream are recorded on the compute stream, which uses them.
    """

    def __init__(
        self, batches: Iterator[Batch], stage: DeviceStage, device: torch.device, dtype: torch.dtype, train: bool
    ) -> None:
        self.batches = batches
        self.stage = stage
        self.device = device
        self.dtype = dtype
        self.train = train
        self.stream = torch.cuda.Stream(device=device)
        self._next: Batch | None = None
        self._exhausted = False
        self._preload()

    def _preload(self) -> None:
        try:
            batch = next(self.batches)
        except StopIteration:
            self._next, self._exhausted = None, True
            return
        if not len(batch):  # every sample was bad: nothing to copy or decode
            self._next = replace(batch, on_device=True)
            return
        on_device = [value for value in batch.inputs.values() if value.is_cuda]
        if on_device:
            # Not a loader's host batch: its tensors were made on the compute stream. Read them after that, and
            # keep the allocator from reusing their memory before the side stream is done with them.
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)
            for value in on_device:
                value.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            self._next = self.stage(batch, self.device, self.dtype, train=self.train)

    def __iter__(self) -> CudaPrefetcher:
        return self

    def __next__(self) -> Batch:
        if self._exhausted and self._next is None:
            raise StopIteration
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self._next
        assert batch is not None
        for value in batch.inputs.values():
            if value.is_cuda:
                # The tensor was made on the side stream; tell the allocator the compute stream uses it too.
                value.record_stream(torch.cuda.current_stream(self.device))
        self._preload()
        return batch
