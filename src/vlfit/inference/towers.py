"""The two towers of a model as standalone modules: what ``vlfit export`` traces and the PyTorch backend runs.

They are built only from the ``ModelFamily`` interface (``encode_image`` / ``encode_text``) and the model's
``InputSpec``, so every family, present or future, exports the same way without code of its own.

The image tower takes **uint8** pixels ``[B, 3, H, W]`` (what the fast CPU pipeline collates) and normalizes them
inside the graph with the model's mean and std, by the same fused multiply-add as the training device stage
(``vlfit.data.device_stage.normalize_uint8``); a deployed graph then needs no preprocessing but resize and crop.
"""

from __future__ import annotations

import torch
from torch import nn

from vlfit.models.family import InputSpec, ModelFamily

IMAGE_INPUT = "pixels"
TEXT_INPUTS = ("input_ids", "attention_mask")
# Not "embedding": the exporter names graph values after their operations, and the towers call aten.embedding.
EMBEDDING_OUTPUT = "normalized_embedding"


class ImageTower(nn.Module):
    """uint8 pixels ``[B, 3, H, W]`` -> L2-normalized image embeddings ``[B, D]``.

    Args:
        family: The model's family (its ``encode_image``).
        model: The model, in eval mode.
        spec: The model's input spec (mean and std of the normalization).
    """

    def __init__(self, family: ModelFamily, model: nn.Module, spec: InputSpec) -> None:
        super().__init__()
        self.family = family
        self.model = model
        mean = torch.tensor(spec.image_mean, dtype=torch.float32)
        std = torch.tensor(spec.image_std, dtype=torch.float32)
        self.register_buffer("scale", (1.0 / (255.0 * std)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", (-mean / std).view(1, -1, 1, 1), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        normalized = torch.addcmul(self.shift, pixels.to(torch.float32), self.scale)
        return self.family.encode_image(self.model, normalized)


class TextTower(nn.Module):
    """Token ids and attention mask ``[B, S]`` -> L2-normalized caption embeddings ``[B, D]``."""

    def __init__(self, family: ModelFamily, model: nn.Module) -> None:
        super().__init__()
        self.family = family
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.family.encode_text(self.model, input_ids, attention_mask)
