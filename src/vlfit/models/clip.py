"""CLIP: any ``transformers.CLIPModel`` checkpoint, the ``clip-*`` presets, and CLIP's softmax contrastive loss.

The loss is the mean of text->image and image->text InfoNCE over L2-normalized embeddings, logits scaled by the
learnable ``logit_scale.exp()``: what ``CLIPModel(return_loss=True)`` returns, and with global negatives the same
over the whole global batch (``vlfit.models.losses.info_nce`` gathers the candidates with gradient).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers import CLIPConfig, CLIPModel
from transformers.models.clip.modeling_clip import CLIPOutput

from vlfit.models.dual_encoder import normalized
from vlfit.models.family import (
    HARD_NEGATIVE_INPUT_IDS,
    IMAGE_KEYS,
    LossEmbeddings,
    ModelFamily,
)
from vlfit.models.logit_scale import install_output_hook
from vlfit.models.losses import (
    HardNegatives,
    Term,
    add_hard_negatives,
    add_image_keys,
    hard_negatives_in,
    image_keys_in,
    info_nce,
    under_autocast,
)

# CLIP's text tower pools at the first ``eos_token_id``, except that ``eos_token_id == 2`` selects its legacy rule
# (the highest token id): a preset's tokenizer puts ``</s>`` at id 4, not RoBERTa's 2 (the ``clip-*`` preset files
# say so in their text_config: bos 0, pad 1, eos 4).
SPECIAL_TOKENS = ("<s>", "<pad>", "<unk>", "<mask>", "</s>")


@dataclass
class CLIPOutputWithScale(CLIPOutput):
    """``CLIPOutput`` plus ``logit_scale`` (the multiplier, ``exp`` of the parameter), as a declared field: DDP and
    accelerate rebuild outputs from their fields."""

    logit_scale: torch.Tensor | None = None


def _add_logit_scale(module: nn.Module, args: tuple, output: Any) -> CLIPOutputWithScale:
    return CLIPOutputWithScale(**output, logit_scale=module.logit_scale.exp())


def text_embeddings(model: CLIPModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """L2-normalized caption embeddings ``[B, projection_dim]``, with gradient."""
    return normalized(model.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output)


def image_embeddings(model: CLIPModel, pixel_values: torch.Tensor) -> torch.Tensor:
    """L2-normalized image embeddings ``[B, projection_dim]`` from normalized pixels, with gradient."""
    return normalized(model.get_image_features(pixel_values=pixel_values).pooler_output)


def loss_terms(texts: torch.Tensor, images: torch.Tensor, hard_negatives: HardNegatives | None = None) -> list[Term]:
    """CLIP's two terms, text->image and image->text (the latter against the hard negatives too, when given)."""
    return [(texts, images), (images, texts, hard_negatives)]


class CLIPFamily(ModelFamily):
    """``CLIPModel`` checkpoints and the ``clip-*`` presets."""

    name = "clip"
    model_types = ("clip",)
    config_class = CLIPConfig
    preset_special_tokens = SPECIAL_TOKENS

    def build(self, config: Any) -> CLIPModel:
        return CLIPModel(config)

    def vision_position_embedding(self, model: nn.Module) -> torch.Tensor:
        return model.vision_model.embeddings.position_embedding.weight

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> CLIPModel:
        return CLIPModel.from_pretrained(name_or_path, **hub_kwargs)

    def image_size(self, config: Any) -> int:
        return int(config.vision_config.image_size)

    def patch_size(self, config: Any) -> int:
        return int(config.vision_config.patch_size)

    def module_groups(self) -> dict[str, tuple[str, ...]]:
        return {"text": ("text_model",), "vision": ("vision_model",)}

    def head_modules(self) -> tuple[str, ...]:
        return ("text_projection", "visual_projection")

    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return text_embeddings(model, input_ids, attention_mask)  # type: ignore[arg-type]

    def encode_image(self, model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        return image_embeddings(model, pixel_values)  # type: ignore[arg-type]

    def prepare_for_training(self, model: nn.Module) -> None:
        install_output_hook(model, _add_logit_scale)

    def contrastive_loss(
        self,
        model: nn.Module,
        inputs: Mapping[str, torch.Tensor],
        *,
        global_negatives: bool = False,
        symmetric: bool = False,  # CLIP's loss is symmetric already
    ) -> torch.Tensor:
        if not (global_negatives or HARD_NEGATIVE_INPUT_IDS in inputs or IMAGE_KEYS in inputs
                or under_autocast(inputs["input_ids"])):  # fmt: skip
            model_inputs = {key: inputs[key] for key in self.model_inputs}
            return model(**model_inputs, return_loss=True).loss  # the model's own loss
        return self.loss_from_embeddings(self.loss_embeddings(model, inputs), global_negatives=global_negatives)

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        unwrapped = extract_model_from_parallel(model)
        install_output_hook(unwrapped, _add_logit_scale)
        outputs = model(**{key: inputs[key] for key in self.model_inputs}, return_loss=False)
        rows = {"text": outputs.text_embeds, "image": outputs.image_embeds}
        add_hard_negatives(rows, inputs, lambda ids, mask: text_embeddings(unwrapped, ids, mask))
        add_image_keys(rows, inputs)
        return LossEmbeddings(rows, {"logit_scale": outputs.logit_scale.mean()})

    def loss_from_embeddings(
        self, embeddings: LossEmbeddings, *, global_negatives: bool = False, symmetric: bool = False
    ) -> torch.Tensor:
        rows = embeddings.rows
        hard = hard_negatives_in(rows)
        terms = loss_terms(rows["text"], rows["image"], hard)
        return info_nce(
            terms, embeddings.shared["logit_scale"], gather=global_negatives, image_keys=image_keys_in(rows)
        )
