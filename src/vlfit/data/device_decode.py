"""JPEG decode on the device (nvJPEG on CUDA), then resize and crop, for ``--decode_on_device``.

Workers only read bytes; the whole batch is decoded where the model runs, by ``torchcodec.decoders.decode_jpeg``
(torchvision's decoders are deprecated since torchvision 0.29; ``torchvision.io.decode_jpeg`` is used only where
torchcodec does not import). Files the device decoder refuses (PNG, WebP, CMYK JPEG, corrupt data) fall back to the
CPU decoder one by one, so one odd file never fails the batch. Device-agnostic: the same functions run on CPU
tensors in tests.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torchvision

from vlfit.data.bad_samples import describe_error
from vlfit.data.decode import DecodeError, check_image_header, decode_scaled, is_jpeg, jpeg_exif_orientation
from vlfit.data.image_transforms import EncodedImage, hwc_to_chw_view, resize_crop_uint8

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JpegDecoder:
    """The library call that decodes JPEGs on the device, and what it does beyond decoding.

    Attributes:
        name: The function, as a user would import it (for the log).
        decode: ``(encoded, device)`` -> RGB uint8 ``[3, H, W]``, or a list of them for a list of encoded tensors.
        applies_exif_orientation: The pixels come back already turned as the EXIF orientation says.
        needs_synchronize: On CUDA, the outputs may still be written after the call returns.
    """

    name: str
    decode: Callable[[torch.Tensor | list[torch.Tensor], torch.device], torch.Tensor | list[torch.Tensor]]
    applies_exif_orientation: bool
    needs_synchronize: bool


@functools.cache
def jpeg_decoder() -> JpegDecoder:
    """torchcodec's ``decode_jpeg`` where it imports, else torchvision's (said once in the log)."""
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError, RuntimeError) as err:  # no wheel, or its native libraries do not load
        logger.warning(
            "device decode uses torchvision.io.decode_jpeg: torchcodec does not import here (%s: %s)",
            type(err).__name__,
            err,
        )
        return JpegDecoder(
            "torchvision.io.decode_jpeg",
            lambda encoded, device: torchvision.io.decode_jpeg(
                encoded, mode=torchvision.io.ImageReadMode.RGB, device=device
            ),
            # torchvision can turn the pixels only on the CPU (apply_exif_orientation): _orient_chw does it here.
            applies_exif_orientation=False,
            needs_synchronize=True,
        )
    return JpegDecoder(
        "torchcodec.decoders.decode_jpeg",
        lambda encoded, device: decode_jpeg(encoded, mode="RGB", device=device),
        # torchcodec always applies the EXIF orientation (libjpeg's markers on the CPU, its own parse of the APP1
        # segment on CUDA) and has no switch to leave it out, so _orient_chw must not turn the pixels again.
        applies_exif_orientation=True,
        # On CUDA it decodes on the caller's current stream and synchronizes that stream before returning
        # (CUDAJpegDecoder::decode_images in torchcodec's DecodeJpegCuda.cpp), so the outputs are complete.
        needs_synchronize=False,
    )


def decode_resize_batch(images: list[EncodedImage], size: int, device: torch.device | str) -> torch.Tensor:
    """Decode a batch of encoded images on ``device`` and resize/crop each to ``size x size`` (uint8).

    JPEGs are decoded together by ``jpeg_decoder()`` (nvJPEG on CUDA). Samples it refuses (PNG, WebP, CMYK JPEG,
    corrupt data) fall back to the CPU decoder one by one, so one odd file never fails the batch. EXIF orientation
    is applied on both paths. JPEG headers are checked first: a declared decompression bomb never reaches the
    device decoder, which would allocate the full declared size.

    Returns:
        uint8 ``[B, 3, size, size]`` on ``device``.

    Raises:
        DecodeError: naming the first sample that no decoder accepts.
    """
    pixels, _ = _decode_resize(images, size, torch.device(device), skip_bad=False)
    return pixels


def decode_resize_batch_skipping_bad(
    images: list[EncodedImage], size: int, device: torch.device | str
) -> tuple[torch.Tensor, list[tuple[int, str, str]]]:
    """``decode_resize_batch``, leaving out the images no decoder accepts instead of failing the batch.

    Returns:
        uint8 ``[B - k, 3, size, size]`` for the images that decoded (in order), and ``(index, sample id, reason)``
        for each of the ``k`` that did not.
    """
    return _decode_resize(images, size, torch.device(device), skip_bad=True)


def _decode_resize(
    images: list[EncodedImage], size: int, device: torch.device, skip_bad: bool
) -> tuple[torch.Tensor, list[tuple[int, str, str]]]:
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    decoder = jpeg_decoder()
    decoded = _decode_jpegs(images, device, decoder)
    failed: list[tuple[int, str, str]] = []
    for i, image in enumerate(images):
        try:
            if i not in decoded:
                pixels = hwc_to_chw_view(decode_scaled(image.data, size, image.sample_id)).to(device)
            elif decoder.applies_exif_orientation:
                pixels = decoded[i]
            else:
                pixels = _orient_chw(decoded[i], jpeg_exif_orientation(image.data))
        except DecodeError as err:
            if not skip_bad:
                raise
            failed.append((i, image.sample_id, describe_error(err, image.sample_id)[1]))
            continue
        out[i] = resize_crop_uint8(pixels, size)
    if failed:
        bad_rows = {i for i, _, _ in failed}
        keep = torch.tensor([i for i in range(len(images)) if i not in bad_rows], dtype=torch.long, device=device)
        out = out.index_select(0, keep)
    return out, failed


def _decode_jpegs(images: list[EncodedImage], device: torch.device, decoder: JpegDecoder) -> dict[int, torch.Tensor]:
    """Decode what ``decoder`` accepts; the rest is left for the CPU decoder (and its errors)."""
    jpeg_index = []
    for i, image in enumerate(images):
        if not is_jpeg(image.data):
            continue
        try:
            check_image_header(image.data, image.sample_id)
        except DecodeError:
            continue  # the CPU decoder raises the same error, naming the sample
        jpeg_index.append(i)
    if not jpeg_index:
        return {}
    tensors = [images[i].tensor() for i in jpeg_index]
    decoded: dict[int, torch.Tensor] = {}
    batched = device.type != "cpu"
    if batched:
        # One call for the batch: nvJPEG decodes it together, much faster than image by image. One bad JPEG
        # fails the whole call, though; then each is tried alone below, to find which go to the CPU decoder.
        try:
            results = decoder.decode(tensors, device)
            decoded = dict(zip(jpeg_index, results, strict=True))
        except Exception:  # RuntimeError mostly, but whatever the decoder raises, the CPU decoder gets the last word
            batched = False
    if not batched:
        # On the CPU both libraries decode a list image by image anyway, so nothing is lost by calling them so.
        for i, tensor in zip(jpeg_index, tensors, strict=True):
            try:
                decoded[i] = decoder.decode(tensor, device)
            except Exception:
                continue
    if decoder.needs_synchronize and device.type == "cuda":
        # torchvision's nvJPEG decode may still write its outputs: wait before any kernel reads them.
        torch.cuda.synchronize(device)
    return decoded


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
