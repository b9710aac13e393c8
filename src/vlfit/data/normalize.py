"""uint8 pixels -> normalized float: the one normalization of every image path.

``(pixels / 255 - mean) / std`` with the input spec's mean and std, computed as ``pixels * scale + shift`` (``scale =
1 / (255 std)``, ``shift = -mean / std``) in one float32 buffer, for square images ``[B, 3, H, W]`` and NaFlex
patches ``[B, N, p * p * 3]`` alike. The training device stage, the image tower vlfit exports (inside its graph), the
VQA model and the Immich export's parity check all call ``normalize_uint8``, so their pixels agree to the bit.
"""

from __future__ import annotations

import torch


def normalize_uint8(
    pixels: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(pixels / 255 - mean) / std`` in ``dtype``, computed in one float32 buffer.

    Args:
        pixels: uint8 ``[B, 3, H, W]`` in any memory layout, or NaFlex patches ``[B, N, p * p * 3]`` (channels last
            in each patch, ``vlfit.data.naflex``).
        mean: ``[3]`` float on the same device (the input spec's ``image_mean``).
        std: ``[3]`` float on the same device.
        dtype: Output dtype (the model's).
        mask: A NaFlex batch's ``pixel_attention_mask`` ``[B, N]``: its padding rows come out 0 (what the processor
            pads its normalized patches with).
        out: A contiguous float32 tensor of ``pixels``' shape to compute in (``ReusedBuffers``); default a new one.
            It is the result when ``dtype`` is float32.
    """
    scale, shift = 1.0 / (255.0 * std), -mean / std
    if pixels.dim() == 3:  # patches: the channels repeat in each patch's row
        repeat = pixels.shape[-1] // mean.numel()
        scale, shift = scale.repeat(repeat).view(1, 1, -1), shift.repeat(repeat).view(1, 1, -1)
    else:
        scale, shift = scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1)
    # The CPU stage batches channels-last (no transpose on the host); the model gets contiguous NCHW, made in the
    # same pass as the conversion to float, then scaled and shifted in place.
    if out is None:
        as_float = pixels.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    else:
        as_float = out.copy_(pixels)
    normalized = as_float.mul_(scale).add_(shift)
    if mask is not None:
        normalized = normalized.mul_(mask.unsqueeze(-1).to(normalized.dtype))
    return normalized.to(dtype)
