"""Unimodal BridgeTower embeddings for retrieval, without running the cross-modal tower.

``BridgeTowerForContrastiveLearning`` takes its text and image contrastive embeddings from the *last layers of
the unimodal encoders*; only the third (cross) embedding needs the fused tower. Retrieval over N images and N
captions therefore needs N text passes and N image passes, not N^2 fused passes. These functions follow the
model's forward step by step (tests check they match it).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BridgeTowerForContrastiveLearning
from transformers.masking_utils import create_bidirectional_mask


@torch.no_grad()
def encode_text(
    model: BridgeTowerForContrastiveLearning, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """L2-normalized text embeddings ``[B, contrastive_hidden_size]``."""
    tower = model.bridgetower
    hidden = tower.text_model.embeddings(input_ids=input_ids)
    mask = create_bidirectional_mask(
        config=tower.config, inputs_embeds=hidden[:, 0:1, :], attention_mask=attention_mask
    )
    for layer in tower.text_model.encoder.layer:
        hidden = layer(hidden, mask)
    return nn.functional.normalize(model.itc_text_head(hidden[:, 0, :]), dim=-1, p=2)


@torch.no_grad()
def encode_image(model: BridgeTowerForContrastiveLearning, pixel_values: torch.Tensor) -> torch.Tensor:
    """L2-normalized image embeddings ``[B, contrastive_hidden_size]`` from normalized pixels."""
    tower = model.bridgetower
    visual = tower.vision_model.visual
    hidden = visual.forward_pre(pixel_values.type(tower.vision_model.dtype))
    for block in visual.transformer.resblocks:
        hidden = block(hidden)
    hidden = visual.forward_post(hidden.type(tower.vision_model.dtype))
    token_type = tower.token_type_embeddings(torch.ones(1, dtype=torch.long, device=hidden.device))
    hidden = tower.cross_modal_image_transform(hidden) + token_type.expand_as(hidden)
    return nn.functional.normalize(model.itc_image_head(hidden[:, 0, :]), dim=-1, p=2)
