"""The two towers of a model as standalone modules: what ``vlfit export`` traces and the PyTorch backend runs.

They are built only from the ``ModelFamily`` interface (``encode_image`` / ``encode_text``) and the model's
``InputSpec``, so every family, present or future, exports the same way without code of its own.

The image tower takes **uint8** pixels ``[B, 3, H, W]`` (what the fast CPU pipeline collates) and normalizes them
inside the graph with the model's mean and std, by the training device stage's own normalization
(``vlfit.data.normalize.normalize_uint8``); a deployed graph then needs no preprocessing but resize and crop.
"""

from __future__ import annotations

import torch
from torch import nn

from vlfit.data.normalize import normalize_uint8
from vlfit.models.family import InputSpec, ModelFamily

IMAGE_INPUT = "pixels"
# A NaFlex model's image graph takes these too (``vlfit.data.naflex``), its patch count a dynamic axis.
PATCH_INPUTS = ("pixel_attention_mask", "spatial_shapes")
TEXT_INPUTS = ("input_ids", "attention_mask")
# Not "embedding": the exporter names graph values after their operations, and the towers call aten.embedding.
EMBEDDING_OUTPUT = "normalized_embedding"


class ImageTower(nn.Module):
    """uint8 pixels ``[B, 3, H, W]`` (NaFlex: patches ``[B, N, p * p * 3]``, their mask and grids) -> L2-normalized
    image embeddings ``[B, D]``.

    Args:
        family: The model's family (its ``encode_image``).
        model: The model, in eval mode.
        spec: The model's input spec (mean and std of the normalization).
    """

    def __init__(self, family: ModelFamily, model: nn.Module, spec: InputSpec) -> None:
        super().__init__()
        self.family = family
        self.model = model
        self.register_buffer("mean", torch.tensor(spec.image_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(spec.image_std, dtype=torch.float32), persistent=False)

    def forward(
        self,
        pixels: torch.Tensor,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings of uint8 pixels, or of a NaFlex model's uint8 patches with their mask and grids
        (``vlfit.data.naflex``)."""
        normalized = normalize_uint8(pixels, self.mean, self.std, mask=pixel_attention_mask)  # padding rows are 0
        if pixel_attention_mask is None:
            return self.family.encode_image(self.model, normalized)
        return self.family.encode_image(
            self.model, normalized, pixel_attention_mask=pixel_attention_mask, spatial_shapes=spatial_shapes
        )


class TextTower(nn.Module):
    """Token ids and attention mask ``[B, S]`` -> L2-normalized caption embeddings ``[B, D]``."""

    def __init__(self, family: ModelFamily, model: nn.Module) -> None:
        super().__init__()
        self.family = family
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.family.encode_text(self.model, input_ids, attention_mask)
