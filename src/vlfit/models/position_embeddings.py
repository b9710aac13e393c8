"""Fixed 2D sine-cosine position embeddings (MAE, MoCo v3) as the starting point of a ViT's learned ones.

A ViT trained from random weights starts with random position embeddings and must learn where each patch is
before it can say where an object is. Sine-cosine embeddings give that from the first step: their lowest
frequencies vary smoothly with the patch's row and column, so "on the left" or "at the top" is close to a linear
read-out of the patches an object covers. They stay trainable; only their initial value changes.
"""

from __future__ import annotations

import math

import torch

from vlfit.errors import ConfigError


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """``[len(positions), dim]``: ``sin`` in the first half, ``cos`` in the second, at ``1 / 10000^(2i/dim)``."""
    if dim % 2:
        raise ConfigError(f"a sine-cosine embedding needs an even width, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """``[grid * grid, dim]`` float32 for a square grid of patches in row-major order: the first half of the width
    encodes the row, the second half the column (``sincos_1d`` each)."""
    if dim % 4:
        raise ConfigError(f"a 2D sine-cosine embedding needs a width divisible by 4, got {dim}")
    rows, columns = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    return torch.cat([sincos_1d(dim // 2, rows.reshape(-1)), sincos_1d(dim // 2, columns.reshape(-1))], dim=1).float()


@torch.no_grad()
def init_vit_position_embedding(weight: torch.Tensor, *, class_token: bool = True) -> None:
    """Overwrite a ViT's ``[positions, dim]`` position-embedding weight with 2D sine-cosine values (zeros for the
    class token's row when ``class_token``).

    Raises:
        ValueError: the patch positions do not form a square grid.
    """
    patches = weight.shape[0] - int(class_token)
    grid = math.isqrt(patches)
    if grid * grid != patches:
        raise ConfigError(f"{patches} patch positions do not form a square grid")
    if class_token:
        weight[0].zero_()
    weight[int(class_token) :] = sincos_2d(weight.shape[1], grid).to(weight.dtype)
