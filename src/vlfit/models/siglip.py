"""SigLIP: any ``transformers.SiglipModel`` checkpoint, the ``siglip-*`` presets, and the sigmoid pairwise loss.

Every (caption, image) pair of the batch is a binary problem: ``-log sigmoid(z * (s * cos + b))`` with ``z = 1``
for the matching pair and ``-1`` for every other, ``s = logit_scale.exp()`` and the learnable bias ``b``; summed
over images and averaged over captions, as ``SiglipModel(return_loss=True)`` computes it (and big_vision trains).
With global negatives each process scores its own captions against every process's images (gathered with
gradient), and its share is scaled so that averaging over processes gives the loss of the concatenated batch.

SigLIP's text tower pools the *last* position and was trained on captions padded to a fixed length without an
attention mask (its processor pads to ``max_length``). Captions here arrive padded to the longest in the batch, so
``text_inputs`` re-pads them to the tower's ``max_position_embeddings`` with the pad token and drops the mask:
a caption's embedding then never depends on the batch it came in, and a checkpoint sees what it was trained on.
A saved folder's tokenizer says the same (``saved_tokenizer_settings``: ``model_max_length`` is the tower's
positions, ``model_input_names`` only ``input_ids``, as SigLIP's own tokenizer configs say), so the call SigLIP's
model card documents, ``processor(text=..., padding="max_length")`` then ``get_text_features(**inputs)``, feeds
plain transformers exactly the ids vlfit embeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel
from transformers.models.siglip.modeling_siglip import SiglipOutput

from vlfit.models.dual_encoder import normalized
from vlfit.models.family import LOCAL_LOSS, InputSpec, LossEmbeddings, LossScope, ModelFamily, pipeline_image_processing
from vlfit.models.logit_scale import install_output_hook
from vlfit.models.losses import (
    HardNegatives,
    add_hard_negatives,
    add_image_keys,
    distributed_world,
    gather_with_grad,
    hard_negatives_in,
    image_keys_in,
    same_image_pairs,
)
from vlfit.models.unwrap import held_model

# The paper's initial temperature and bias: log(10) and -10 (transformers initializes both to 0).
INITIAL_LOGIT_SCALE = math.log(10.0)
INITIAL_LOGIT_BIAS = -10.0


@dataclass
class SiglipOutputWithScale(SiglipOutput):
    """``SiglipOutput`` plus ``logit_scale`` (``exp`` of the parameter) and ``logit_bias``, as declared fields."""

    logit_scale: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None


def _add_scale_and_bias(module: nn.Module, args: tuple, output: Any) -> SiglipOutputWithScale:
    return SiglipOutputWithScale(**output, logit_scale=module.logit_scale.exp(), logit_bias=module.logit_bias)


def text_length(config: Any) -> int:
    return int(config.text_config.max_position_embeddings)


def saved_tokenizer_settings(config: Any) -> dict[str, Any]:
    """The tokenizer settings a saved SigLIP folder carries: under them ``tokenizer(text, padding="max_length")``
    gives the ids ``text_inputs`` makes (padded on the right to ``max_position_embeddings``) and no attention mask.
    """
    return {"model_input_names": ["input_ids"], "model_max_length": text_length(config), "padding_side": "right"}


def text_inputs(config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Captions as SigLIP's text tower was trained on them: padded (or cut) to ``max_position_embeddings`` with the
    pad token, no attention mask (see the module doc)."""
    length = text_length(config)
    pad = config.text_config.pad_token_id
    ids = input_ids.masked_fill(attention_mask == 0, pad)[:, :length]
    if ids.shape[1] < length:
        ids = F.pad(ids, (0, length - ids.shape[1]), value=pad)
    return {"input_ids": ids}


def text_embeddings(model: SiglipModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """L2-normalized caption embeddings, with gradient."""
    return normalized(model.get_text_features(**text_inputs(model.config, input_ids, attention_mask)).pooler_output)


def image_embeddings(model: SiglipModel, pixel_values: torch.Tensor) -> torch.Tensor:
    return normalized(model.get_image_features(pixel_values=pixel_values).pooler_output)


def sigmoid_loss(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
    *,
    gather: bool = False,
    hard_negatives: HardNegatives | None = None,
    group: Any = None,
    image_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """SigLIP's loss of this process's captions, in float32 whatever the autocast state.

    Args:
        text_embeds, image_embeds: ``[n, d]`` L2-normalized embeddings of this process's pairs.
        logit_scale: The multiplier (``exp`` of the parameter); ``logit_bias`` the bias.
        gather: Score against every process's images (global negatives).
        hard_negatives: Per-image alternative captions, each one more negative pair of its image.
        image_keys: ``[n]`` int64, which image each pair shows: a caption and another row's image that is the
            same image are neither a positive nor a negative pair (left out). ``None``: all images differ.

    Returns:
        Local: the sum of every pair's loss over the captions' count (``SiglipModel``'s loss). Global: this
        process's share, ``sum * world / global_batch``, which averaged over processes is the global loss.
    """
    with torch.autocast(device_type=text_embeds.device.type, enabled=False):
        scale, bias = logit_scale.float().reshape(()), logit_bias.float().reshape(())
        texts = text_embeds.float()
        images = image_embeds.float()
        rows = texts.shape[0]
        world = distributed_world(group) if gather else 1
        all_images, offset, total = gather_with_grad(images, group) if world > 1 else (images, 0, rows)
        logits = texts @ all_images.t() * scale + bias
        signs = -torch.ones_like(logits)
        signs[torch.arange(rows, device=logits.device), torch.arange(offset, offset + rows, device=logits.device)] = 1
        pair_losses = -F.logsigmoid(signs * logits)
        if image_keys is not None:
            pair_losses = pair_losses.masked_fill(same_image_pairs(image_keys, gather=gather, group=group), 0.0)
        loss_sum = pair_losses.sum()
        if hard_negatives is not None:
            similarity = torch.einsum("nd,nkd->nk", images, hard_negatives.embeds.float()) * scale + bias
            loss_sum = loss_sum - F.logsigmoid(-similarity)[hard_negatives.valid].sum()
        return loss_sum * (world / total)


class SiglipFamily(ModelFamily):
    """``SiglipModel`` checkpoints (SigLIP; SigLIP 2 checkpoints load with ``Siglip2Model``, not handled here) and
    the ``siglip-*`` presets."""

    stretches_text_positions = True  # one learned position table (vlfit.models.long_captions)

    name = "siglip"
    model_types = ("siglip",)
    config_class = SiglipConfig
    vision_class_token = False

    def saved_image_processor(self, inputs: InputSpec) -> SiglipImageProcessor:
        # SigLIP's own processors squash the whole image to the square; vlfit crops its central square. The class
        # takes a short-side resize and a center crop too: set to them, plain transformers sees vlfit's pixels.
        return SiglipImageProcessor(**pipeline_image_processing(inputs))

    def build(self, config: Any) -> SiglipModel:
        return SiglipModel(config)

    def vision_position_embedding(self, model: nn.Module) -> torch.Tensor:
        return model.vision_model.embeddings.position_embedding.weight

    def initialize_preset(self, model: nn.Module, preset: str) -> None:
        super().initialize_preset(model, preset)
        with torch.no_grad():
            model.logit_scale.fill_(INITIAL_LOGIT_SCALE)
            model.logit_bias.fill_(INITIAL_LOGIT_BIAS)

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> SiglipModel:
        return SiglipModel.from_pretrained(name_or_path, **hub_kwargs)

    def image_size(self, config: Any) -> int:
        return int(config.vision_config.image_size)

    def patch_size(self, config: Any) -> int:
        return int(config.vision_config.patch_size)

    def max_text_length(self, config: Any) -> int:
        return text_length(config)

    def saved_tokenizer_settings(self, config: Any) -> dict[str, Any]:
        """Tokenizer settings of a saved folder (read by ``vlfit.models.loading.save_inputs``)."""
        return saved_tokenizer_settings(config)

    def module_groups(self) -> dict[str, tuple[str, ...]]:
        return {"text": ("text_model",), "vision": ("vision_model",)}

    def head_modules(self) -> tuple[str, ...]:
        return ("text_model.head", "vision_model.head")

    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return text_embeddings(model, input_ids, attention_mask)  # type: ignore[arg-type]

    def encode_image(self, model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        return image_embeddings(model, pixel_values)  # type: ignore[arg-type]

    def prepare_for_training(self, model: nn.Module) -> None:
        install_output_hook(model, _add_scale_and_bias)

    def contrastive_loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], scope: LossScope = LOCAL_LOSS
    ) -> torch.Tensor:  # every pair is scored once, in both directions at once
        return self.loss_from_embeddings(self.loss_embeddings(model, inputs), scope)

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        unwrapped = held_model(model)
        install_output_hook(unwrapped, _add_scale_and_bias)
        text = text_inputs(unwrapped.config, inputs["input_ids"], inputs["attention_mask"])
        outputs = model(**text, pixel_values=inputs["pixel_values"], return_loss=False)
        rows = {"text": outputs.text_embeds, "image": outputs.image_embeds}
        add_hard_negatives(rows, inputs, lambda ids, mask: text_embeddings(unwrapped, ids, mask))
        add_image_keys(rows, inputs)
        # DataParallel (several GPUs, one process) stacks one copy of each scalar per replica.
        shared = {"logit_scale": outputs.logit_scale.mean(), "logit_bias": outputs.logit_bias.mean()}
        return LossEmbeddings(rows, shared)

    def loss_from_embeddings(self, embeddings: LossEmbeddings, scope: LossScope = LOCAL_LOSS) -> torch.Tensor:
        rows = embeddings.rows
        hard = hard_negatives_in(rows)
        return sigmoid_loss(
            rows["text"],
            rows["image"],
            embeddings.shared["logit_scale"],
            embeddings.shared["logit_bias"],
            gather=scope.global_negatives,
            hard_negatives=hard,
            image_keys=image_keys_in(rows),
        )
