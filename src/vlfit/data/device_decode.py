"""JPEG decode on the device (nvJPEG on CUDA), then resize and crop, for ``--decode_on_device``.

Workers only read bytes; the whole batch is decoded where the model runs. Files the device decoder refuses (PNG,
WebP, CMYK JPEG, corrupt data) fall back to the CPU decoder one by one, so one odd file never fails the batch.
Device-agnostic: the same functions run on CPU tensors in tests.
"""

from __future__ import annotations

import torch
import torchvision

from vlfit.data.bad_samples import describe_error
from vlfit.data.decode import DecodeError, check_image_header, decode_scaled, is_jpeg, jpeg_exif_orientation
from vlfit.data.image_transforms import EncodedImage, hwc_to_chw_view, resize_crop_uint8


def decode_resize_batch(images: list[EncodedImage], size: int, device: torch.device | str) -> torch.Tensor:
    """Decode a batch of encoded images on ``device`` and resize/crop each to ``size x size`` (uint8).

    JPEGs are decoded together by ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA). Samples it refuses (PNG, WebP,
    CMYK JPEG, corrupt data) fall back to the CPU decoder one by one, so one odd file never fails the batch.
    EXIF orientation is applied on both paths. JPEG headers are checked first: a declared decompression bomb
    never reaches ``decode_jpeg``, which would allocate the full declared size.

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
    decoded = _decode_jpegs(images, device)
    failed: list[tuple[int, str, str]] = []
    for i, image in enumerate(images):
        try:
            if i in decoded:
                pixels = _orient_chw(decoded[i], jpeg_exif_orientation(image.data))
            else:
                pixels = hwc_to_chw_view(decode_scaled(image.data, size, image.sample_id)).to(device)
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


def _decode_jpegs(images: list[EncodedImage], device: torch.device) -> dict[int, torch.Tensor]:
    """Decode what ``torchvision.io.decode_jpeg`` accepts; the rest is left for the CPU decoder (and its errors)."""
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
    decoded: dict[int, torch.Tensor] = {}
    tensors = [images[i].tensor() for i in jpeg_index]
    try:
        results = torchvision.io.decode_jpeg(tensors, mode=torchvision.io.ImageReadMode.RGB, device=device)
        if device.type == "cuda":
            # decode_jpeg runs on an internal stream: wait for it before any kernel reads the outputs.
            torch.cuda.synchronize(device)
        return dict(zip(jpeg_index, results, strict=True))
    except Exception:  # RuntimeError mostly, but whatever torchvision raises, the CPU decoder gets the last word
        # One bad JPEG fails the batched call; decode individually to find which ones to send to the CPU.
        for i, tensor in zip(jpeg_index, tensors, strict=True):
            try:
                decoded[i] = torchvision.io.decode_jpeg(tensor, mode=torchvision.io.ImageReadMode.RGB, device=device)
            except Exception:
                continue
        if device.type == "cuda":
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
