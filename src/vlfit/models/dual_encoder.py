"""What the dual-encoder families (CLIP, SigLIP) share: preset sizes, position-embedding init, normalization.

A dual encoder embeds captions and images separately (``get_text_features`` / ``get_image_features``, whose
``pooler_output`` is the projected embedding) and scores every caption against every image; nothing is fused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlfit.errors import ConfigError
from vlfit.models.position_embeddings import init_vit_position_embedding


@dataclass(frozen=True)
class DualEncoderPreset:
    """Sizes of one dual-encoder architecture (a text transformer, a ViT, a projection to a shared space)."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    vocab_size: int
    max_positions: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    patch_size: int
    image_size: int
    projection_dim: int
    # "random" (transformers' init) or "sincos" (2D sine-cosine, vlfit.models.position_embeddings): models trained
    # from scratch learn where patches are faster from sincos (docs/demo-recipe.md).
    vision_position_init: str = "random"
    tokenizer_vocab_size: int | None = None  # size of the BPE trained for this preset when no tokenizer is given

    def text_config(self, **extra: Any) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.text_hidden,
            "num_hidden_layers": self.text_layers,
            "num_attention_heads": self.text_heads,
            "intermediate_size": self.text_intermediate,
            "max_position_embeddings": self.max_positions,
            **extra,
        }

    def vision_config(self, **extra: Any) -> dict[str, Any]:
        return {
            "hidden_size": self.vision_hidden,
            "num_hidden_layers": self.vision_layers,
            "num_attention_heads": self.vision_heads,
            "intermediate_size": self.vision_intermediate,
            "patch_size": self.patch_size,
            "image_size": self.image_size,
            **extra,
        }


def initialize_position_embedding(preset_name: str, preset: DualEncoderPreset, weight: torch.Tensor, *,
                                  class_token: bool) -> None:  # fmt: skip
    """Start a freshly built preset's ViT position embeddings as its ``vision_position_init`` says."""
    if preset.vision_position_init == "sincos":
        init_vit_position_embedding(weight, class_token=class_token)
    elif preset.vision_position_init != "random":
        raise ConfigError(
            f"preset {preset_name}: unknown vision_position_init {preset.vision_position_init!r} (random or sincos)"
        )


def normalized(embeddings: torch.Tensor) -> torch.Tensor:
    return nn.functional.normalize(embeddings, dim=-1, p=2)
