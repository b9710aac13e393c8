"""CLIP: any ``transformers.CLIPModel`` checkpoint, random-init presets, and CLIP's softmax contrastive loss.

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
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
from transformers.models.clip.modeling_clip import CLIPOutput

from vlfit.models.dual_encoder import (
    DualEncoderPreset,
    initialize_position_embedding,
    normalized,
)
from vlfit.models.family import (
    HARD_NEGATIVE_INPUT_IDS,
    IMAGE_KEYS,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
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
)

# CLIP's text tower pools at the first ``eos_token_id``, except that ``eos_token_id == 2`` selects its legacy rule
# (the highest token id): a preset's tokenizer puts ``</s>`` at id 4, not RoBERTa's 2.
SPECIAL_TOKENS = ("<s>", "<pad>", "<unk>", "<mask>", "</s>")
TOKEN_IDS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 4}

PRESETS: dict[str, DualEncoderPreset] = {
    # A few hundred thousand parameters, for tests.
    "clip-tiny": DualEncoderPreset(
        text_hidden=64, text_layers=2, text_heads=2, text_intermediate=128, vocab_size=1024, max_positions=77,
        vision_hidden=64, vision_layers=2, vision_heads=2, vision_intermediate=128, patch_size=16, image_size=64,
        projection_dim=64, vision_position_init="sincos", tokenizer_vocab_size=1024,
    ),
    # The width and depth of BridgeTower's `small-p8` (what `make demo` trains): 8-pixel patches at 80 px.
    "clip-small": DualEncoderPreset(
        text_hidden=192, text_layers=4, text_heads=4, text_intermediate=768, vocab_size=4096, max_positions=77,
        vision_hidden=192, vision_layers=4, vision_heads=4, vision_intermediate=768, patch_size=8, image_size=80,
        projection_dim=128, vision_position_init="sincos", tokenizer_vocab_size=4096,
    ),
    # The shapes of openai/clip-vit-base-patch32 (about 151M parameters).
    "clip-base": DualEncoderPreset(
        text_hidden=512, text_layers=12, text_heads=8, text_intermediate=2048, vocab_size=49408, max_positions=77,
        vision_hidden=768, vision_layers=12, vision_heads=12, vision_intermediate=3072, patch_size=32,
        image_size=224, projection_dim=512,
    ),
}  # fmt: skip


def preset_config(name: str) -> CLIPConfig:
    p = PRESETS[name]
    return CLIPConfig(
        text_config=p.text_config(**TOKEN_IDS),
        vision_config=p.vision_config(),
        projection_dim=p.projection_dim,
        logit_scale_init_value=2.6592,  # ln(1 / 0.07), CLIP's initial temperature
    )


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
    preset_special_tokens = SPECIAL_TOKENS

    def preset_names(self) -> tuple[str, ...]:
        return tuple(PRESETS)

    def preset_config(self, preset: str) -> CLIPConfig:
        return preset_config(preset)

    def preset_tokenizer_vocab_size(self, preset: str) -> int:
        p = PRESETS[preset]
        return p.tokenizer_vocab_size or p.vocab_size

    def preset_image_processor(self, preset: str) -> CLIPImageProcessor:
        size = PRESETS[preset].image_size
        return CLIPImageProcessor(
            size={"shortest_edge": size},
            crop_size={"height": size, "width": size},
            image_mean=list(OPENAI_CLIP_MEAN),
            image_std=list(OPENAI_CLIP_STD),
        )

    def build(self, config: Any) -> CLIPModel:
        return CLIPModel(config)

    def initialize_preset(self, model: nn.Module, preset: str) -> None:
        weight = model.vision_model.embeddings.position_embedding.weight
        initialize_position_embedding(preset, PRESETS[preset], weight, class_token=True)

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
        if not (global_negatives or HARD_NEGATIVE_INPUT_IDS in inputs or IMAGE_KEYS in inputs):
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
