"""CLIP: any ``transformers.CLIPModel`` checkpoint, the ``clip-*`` presets, and CLIP's softmax contrastive loss; and
MetaCLIP 2 (``MetaClip2Model``: CLIP's towers and interface, another tokenizer and pooling), the same family with its
own model class.

The loss is the mean of text->image and image->text InfoNCE over L2-normalized embeddings, logits scaled by the
learnable ``logit_scale.exp()``: what ``CLIPModel(return_loss=True)`` returns, and with global negatives the same
over the whole global batch (``vlfit.models.losses.info_nce`` gathers the candidates with gradient).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, MetaClip2Config, MetaClip2Model
from transformers.models.clip.modeling_clip import CLIPOutput

from vlfit.errors import ConfigError
from vlfit.models.dual_encoder import normalized
from vlfit.models.family import (
    HARD_NEGATIVE_INPUT_IDS,
    IMAGE_KEYS,
    LOCAL_LOSS,
    LossEmbeddings,
    LossScope,
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
from vlfit.models.unwrap import held_model

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
    """``CLIPModel`` checkpoints and the ``clip-*`` presets; a subclass names another model class with CLIP's
    interface (``get_text_features`` / ``get_image_features``, ``CLIPOutput``'s fields) in ``model_class``."""

    stretches_text_positions = True  # one learned position table (vlfit.models.long_captions)

    name = "clip"
    model_types = ("clip",)
    config_class = CLIPConfig
    model_class: Any = CLIPModel
    preset_special_tokens = SPECIAL_TOKENS

    def build(self, config: Any) -> nn.Module:
        return self.model_class(config)

    def vision_position_embedding(self, model: nn.Module) -> torch.Tensor:
        return model.vision_model.embeddings.position_embedding.weight

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> nn.Module:
        return self.model_class.from_pretrained(name_or_path, **hub_kwargs)

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
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], scope: LossScope = LOCAL_LOSS
    ) -> torch.Tensor:  # CLIP's loss is symmetric already
        if not (scope.global_negatives or HARD_NEGATIVE_INPUT_IDS in inputs or IMAGE_KEYS in inputs
                or under_autocast(inputs["input_ids"])):  # fmt: skip
            model_inputs = {key: inputs[key] for key in self.model_inputs}
            return model(**model_inputs, return_loss=True).loss  # the model's own loss
        return self.loss_from_embeddings(self.loss_embeddings(model, inputs), scope)

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        unwrapped = held_model(model)
        install_output_hook(unwrapped, _add_logit_scale)
        outputs = model(**{key: inputs[key] for key in self.model_inputs}, return_loss=False)
        rows = {"text": outputs.text_embeds, "image": outputs.image_embeds}
        add_hard_negatives(rows, inputs, lambda ids, mask: text_embeddings(unwrapped, ids, mask))
        add_image_keys(rows, inputs)
        return LossEmbeddings(rows, {"logit_scale": outputs.logit_scale.mean()})

    def loss_from_embeddings(self, embeddings: LossEmbeddings, scope: LossScope = LOCAL_LOSS) -> torch.Tensor:
        rows = embeddings.rows
        hard = hard_negatives_in(rows)
        terms = loss_terms(rows["text"], rows["image"], hard)
        return info_nce(
            terms, embeddings.shared["logit_scale"], gather=scope.global_negatives, image_keys=image_keys_in(rows)
        )


class MetaClip2Family(CLIPFamily):
    """MetaCLIP 2 (``MetaClip2Model``: ``facebook/metaclip-2-worldwide-*`` checkpoints, 300+ languages) and the
    ``metaclip2-*`` presets: CLIP's towers, loss and heads, with an XLM-R tokenizer (a preset's: the byte-level BPE
    every preset trains, at XLM-R's special-token ids).

    Its text tower pools at the first ``eos_token_id`` of each caption, with no legacy rule: a caption the tokenizer
    does not end with that id (another model's tokenizer) pools at its first token and every caption embeds alike.
    Truncation keeps the end token (the tokenizer adds it after cutting), and padding comes after it.
    """

    name = "metaclip2"
    model_types = ("metaclip_2",)
    config_class = MetaClip2Config
    model_class = MetaClip2Model
    # XLM-R's ids, as the real checkpoints' tokenizer has them: <s> 0, <pad> 1, </s> 2, <unk> 3.
    preset_special_tokens = ModelFamily.preset_special_tokens

    def check_tokenizer(self, config: Any, tokenizer: Any) -> None:
        """Refuse a tokenizer that does not end a caption with the id the text tower pools at."""
        pooled_at = config.get_text_config().eos_token_id
        ends = tokenizer("a")["input_ids"][-1:]
        if ends != [pooled_at]:
            raise ConfigError(
                f"the tokenizer ends a caption with id {ends[0] if ends else None} but the MetaCLIP 2 text tower pools "
                f"at the first token {pooled_at} (text_config.eos_token_id): every caption would embed as its first "
                "token; use the checkpoint's own tokenizer (drop --tokenizer_name) or one that ends captions with it"
            )
