"""Per-sample CPU stage: encoded bytes in, model-sized pixels out. Runs inside DataLoader workers.

Three pipelines, selected by ``--image_pipeline`` / ``--decode_on_device``:

- ``reference``: what run_bridgetower.py does: Pillow decode, float, bicubic resize, center crop, normalize.
  Output: float32 ``[3, S, S]``, normalized.
- ``fast``: DCT-scaled decode, then antialiased resize and crop on **uint8**. Output: uint8 ``[3, S, S]``;
  normalization happens per batch on the device (``device_stage``), so 4x fewer bytes cross the worker pipe
  and the host-to-device copy.
- device decode: no decode at all here; the encoded bytes travel to the device stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as F
from torchvision.transforms import InterpolationMode

from vlfit.data.decode import check_image_header, decode_pil, decode_reduced
from vlfit.data.worker_memory import new_uint8

# The antialiased bicubic kernel ``interpolate`` calls on CPU, in its form that writes into a given tensor.
_RESIZE_INTO = torch.ops.aten._upsample_bicubic2d_aa.out
# The antialiased kernels ``interpolate`` calls, in their form that takes the scale apart from the output size.
_KERNELS = {"bicubic": torch.ops.aten._upsample_bicubic2d_aa, "bilinear": torch.ops.aten._upsample_bilinear2d_aa}


def new_image_batch(count: int, size: int, *, shared: bool = False) -> torch.Tensor:
    """An uninitialized uint8 ``[count, 3, size, size]`` batch, channels-last (the layout ``stack_images`` gives),
    for a transform to write its images into, row by row (``resize_crop_uint8(..., out=batch[i])``).

    Args:
        count: Images in the batch.
        size: Image side.
        shared: A loader worker's batch: in shared memory where it crosses to the main process through it (larger
            than what a batch carries by value, ``vlfit.data.worker_memory``), so it arrives there uncopied.
    """
    return new_uint8((count, size, size, 3), shared=shared).permute(0, 3, 1, 2)


def center_resize_geometry(height: float, width: float, size: int) -> tuple[int, int, int, int]:
    """Where "resize the short side to ``size``, then cut the central ``size x size``" puts an image:
    ``(resized_height, resized_width, top, left)``, rounded as transformers' image processors round them (the long
    side ``int(size * long / short)``, as torchvision's ``Resize`` too; the offsets ``(side - size) // 2``), so that
    a saved folder's processor gives the pixels vlfit gives."""
    if height <= width:
        resized_height, resized_width = size, int(size * width / height)
    else:
        resized_height, resized_width = int(size * height / width), size
    return resized_height, resized_width, (resized_height - size) // 2, (resized_width - size) // 2


def resize_box(
    image: torch.Tensor, height: int, width: int, box: tuple[float, float, float, float], mode: str = "bicubic"
) -> torch.Tensor:
    """The ``box`` (``(top, left, height, width)``, fractional: ``vlfit.data.decode.ScaledPixels.box``) of a uint8
    CPU image ``[1, 3, H, W]`` resampled to ``height x width``, antialiased, each output pixel where a resize of the
    image decoded at full size puts it. The kernel maps output pixels from the image's first row and column, so a
    box that starts later is resampled flipped (its excess then last, where the kernel reads it only as the edge's
    neighbour) and the result flipped back: a flip and the resize commute."""
    top, left, box_height, box_width = box
    flips = [dim for dim, start in ((2, top), (3, left)) if start]
    flipped = image.flip(flips) if flips else image
    resized = _KERNELS[mode](flipped, [height, width], False, height / box_height, width / box_width)
    return resized.flip(flips) if flips else resized


def resize_crop_uint8(
    image: torch.Tensor,
    size: int,
    crop_box: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
    image_box: tuple[float, float, float, float] | None = None,
) -> torch.Tensor:
    """Resize the short side to ``size`` and cut the central square (bicubic, antialiased), staying uint8; or cut
    ``crop_box`` and resize it to ``size x size``.

    The center path resizes the whole image, then crops, with ``center_resize_geometry``'s rounding: what the
    image processor of every saved folder computes. (Cropping the
    central square first resamples fewer pixels, but from a window up to a pixel off theirs, and without the
    neighbours the kernel reads at its edges: plain transformers' embeddings then drifted from vlfit's.)
    Device-agnostic: the CPU stage and the device-decode stage share it.

    Args:
        image: uint8 ``[3, H, W]``. A channels-last view (what ``permute`` of an HWC array gives) is fastest on CPU.
        size: Output side.
        crop_box: ``(top, left, height, width)`` to cut and resize instead (random resized crop).
        out: A uint8 ``[3, size, size]`` tensor on ``image``'s device to write the result into (a row of
            ``new_image_batch``); default a new one.
        image_box: Where the whole image lies in ``image`` (a DCT-scaled decode's ``ScaledPixels.box``, CPU only),
            for the center path; default all of it.

    Returns:
        uint8 ``[3, size, size]``: ``out`` when given, else channels-last (an HWC buffer) when ``image`` is, else
        contiguous.
    """
    height, width = image.shape[-2:]
    if crop_box is None:
        extent = image_box[2:] if image_box is not None else (height, width)
        resized_height, resized_width, cut_top, cut_left = center_resize_geometry(*extent, size)
        crop_box = (0, 0, height, width)
    else:
        resized_height, resized_width, cut_top, cut_left = size, size, 0, 0
        image_box = None
    top, left, crop_height, crop_width = crop_box
    region = image[..., top : top + crop_height, left : left + crop_width].unsqueeze(0)
    # Decoders give HWC (channels-last) pixels. Kept channels-last and made dense, the crop takes torch's
    # vectorized uint8 resampling path on CPU (about 1.5x faster than on the strided crop or on CHW), and the
    # result needs no transposing copy: ``stack_images`` batches it as it is.
    memory_format = torch.channels_last if image.stride(-3) == 1 else torch.contiguous_format
    region = region.contiguous(memory_format=memory_format)
    if memory_format == torch.channels_last:
        # A size-1 batch dimension can carry any stride; torch then reads a channels-last view whose batch stride is
        # not its size as ambiguous and allocates a contiguous output (pytorch#68430). Restating it is free.
        region = region.as_strided(region.shape, (region.numel(), *region.stride()[1:]))
    square = (resized_height, resized_width) == (size, size)
    if image_box is not None:
        resized = resize_box(region, resized_height, resized_width, image_box)[0]
    elif (crop_height, crop_width) == (resized_height, resized_width):  # prepared data is at the model's size already
        resized = region[0]
    elif region.device.type == "cpu":
        # torch's native uint8 kernel, which torchvision's resize also calls on CPU (its checks cost 0.05 ms an image).
        if out is not None and square:
            batched = out.unsqueeze(0).as_strided((1, *out.shape), (out.numel(), *out.stride()))  # as above
            _RESIZE_INTO(region, [size, size], False, None, None, out=batched)
            return out
        resized = torch.nn.functional.interpolate(
            region, size=(resized_height, resized_width), mode="bicubic", antialias=True
        )[0]
    else:
        # Elsewhere (nvJPEG output on CUDA) torch has no uint8 bicubic: torchvision resamples in float and rounds.
        resized = F.resize(
            region, [resized_height, resized_width], interpolation=InterpolationMode.BICUBIC, antialias=True
        )[0]
    cut = resized[:, cut_top : cut_top + size, cut_left : cut_left + size]
    if out is not None:
        return out.copy_(cut)
    # Dense again, in the layout it came in (an HWC buffer for channels-last: what ``stack_images`` batches as is).
    return cut.permute(1, 2, 0).contiguous().permute(2, 0, 1) if cut.stride(-3) == 1 else cut.contiguous()


def stack_images(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """Batch ``[3, H, W]`` images into ``[B, 3, H, W]``: without a copy when they are the rows of one
    ``new_image_batch`` in order, else with one plain copy per image.

    Channels-last images (what ``resize_crop_uint8`` returns on CPU) are stacked as HWC, so the batch is
    channels-last too and no pixel is transposed on the host; the device stage produces the model's layout.
    Other images are stacked as they are.
    """
    batch = _batch_of_rows(images)
    if batch is not None:
        return batch
    if all(image.dim() == 3 and image.permute(1, 2, 0).is_contiguous() for image in images):
        return torch.stack([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)
    return torch.stack(list(images))


def _batch_of_rows(images: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The channels-last ``[B, 3, H, W]`` tensor whose rows ``images`` are, when they are exactly that: one storage
    holding nothing else, row ``i`` at offset ``i`` rows, each an HWC image. None otherwise."""
    first = images[0]
    if first.dim() != 3 or not first.permute(1, 2, 0).is_contiguous():
        return None
    storage = first.untyped_storage()
    row_bytes = first.numel() * first.element_size()
    if first.data_ptr() != storage.data_ptr() or storage.nbytes() != row_bytes * len(images):
        return None
    for i, image in enumerate(images):
        if (
            image.data_ptr() != first.data_ptr() + i * row_bytes
            or image.untyped_storage().data_ptr() != storage.data_ptr()
            or image.shape != first.shape
            or image.stride() != first.stride()
            or image.dtype != first.dtype
        ):
            return None
    return first.as_strided((len(images), *first.shape), (first.numel(), *first.stride()))


def hwc_to_chw_view(pixels: np.ndarray) -> torch.Tensor:
    """A ``[3, H, W]`` uint8 view of an HWC array without copying (channels-last strides)."""
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)


class FastImageTransform:
    """bytes -> uint8 ``[3, S, S]``: DCT-scaled decode, uint8 resize and crop.

    Args:
        image_size: Model input side.
        random_resized_crop: Sample a crop of ``scale`` of the area and ``ratio`` aspect before resizing.
        scale: Area range for the random crop.
        ratio: Aspect-ratio range for the random crop.
    """

    def __init__(
        self,
        image_size: int,
        random_resized_crop: bool = False,
        scale: tuple[float, float] = (0.5, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        self.image_size = image_size
        self.random_resized_crop = random_resized_crop
        self.scale = scale
        self.ratio = ratio

    def __call__(self, data: bytes, sample_id: str = "?", out: torch.Tensor | None = None) -> torch.Tensor:
        """The image's pixels; written into ``out`` (a row of ``new_batch``) when given."""
        decoded = decode_reduced(data, self.image_size, self.image_size, sample_id)
        image = hwc_to_chw_view(decoded.pixels)
        if self.random_resized_crop:
            box = tuple(T.RandomResizedCrop.get_params(image, list(self.scale), list(self.ratio)))
            return resize_crop_uint8(image, self.image_size, box, out=out)  # type: ignore[arg-type]
        return resize_crop_uint8(image, self.image_size, out=out, image_box=decoded.box if decoded.reduced else None)

    def new_batch(self, count: int, *, shared: bool = False) -> torch.Tensor:
        """A batch for ``count`` images of this transform to be written into (see ``new_image_batch``)."""
        return new_image_batch(count, self.image_size, shared=shared)


class _CenterCrop(torch.nn.Module):
    """The central ``size x size``, its offsets rounded down as transformers' image processors and
    ``center_resize_geometry`` round them (torchvision's ``CenterCrop`` rounds them to the nearest: a pixel apart
    when the margin is odd)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        top, left = (height - self.size) // 2, (width - self.size) // 2
        return image[..., top : top + self.size, left : left + self.size]


class ReferenceImageTransform:
    """bytes -> normalized float32 ``[3, S, S]``, as run_bridgetower.py computes it (Pillow, float, bicubic)."""

    def __init__(self, image_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.image_size = image_size
        self.transforms = torch.nn.Sequential(
            T.Resize([image_size], interpolation=InterpolationMode.BICUBIC, antialias=True),
            _CenterCrop(image_size),
            T.Normalize(list(mean), list(std)),
        )

    def __call__(self, data: bytes, sample_id: str = "?") -> torch.Tensor:
        image = T.functional.to_tensor(decode_pil(data, sample_id))
        with torch.no_grad():
            return self.transforms(image)


class EncodedImage:
    """Encoded bytes passed through to the device stage untouched.

    Deliberately not a tensor and without ``.to``: accelerate and the Trainer move tensors to the device, but
    nvJPEG wants its inputs on the CPU.
    """

    __slots__ = ("data", "sample_id")

    def __init__(self, data: bytes, sample_id: str) -> None:
        self.data = data
        self.sample_id = sample_id

    def tensor(self) -> torch.Tensor:
        """The bytes as a 1-D uint8 CPU tensor (what the JPEG decoders of ``vlfit.data.device_decode`` take)."""
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)


class PassThroughEncoded:
    """bytes -> ``EncodedImage`` (device decode: workers read and tokenize only).

    The header is checked here (microseconds, no decode): a sample that is empty, not an image or a declared
    decompression bomb raises ``DecodeError`` in the worker, where the dataset can still replace it, instead of
    at device-decode time, where the batch is already formed.
    """

    def __call__(self, data: bytes, sample_id: str = "?") -> EncodedImage:
        check_image_header(data, sample_id)
        return EncodedImage(data, sample_id)
