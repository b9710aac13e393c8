"""BridgeTower: its presets, unimodal embeddings, and its contrastive loss.

``BridgeTowerForContrastiveLearning`` takes its text and image contrastive embeddings from the *last layers of the
unimodal encoders*; only the third (cross) embedding needs the fused tower. Retrieval over N images and N captions
therefore needs N text passes and N image passes, not N^2 fused passes: ``encode_text`` and ``encode_image``
follow the model's forward step by step (tests check they match it).

Its loss averages three one-directional InfoNCE terms over L2-normalized embeddings: text -> image,
text -> cross-modal and image -> cross-modal, each with logits scaled by ``logit_scale.exp()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bridgetower.modeling_bridgetower import (
    BridgeTowerContrastiveOutput,
    BridgeTowerSelfAttention,
)

from vlfit.errors import ConfigError
from vlfit.models import activation_checkpointing
from vlfit.models.family import (
    HARD_NEGATIVE_INPUT_IDS,
    IMAGE_KEYS,
    LOCAL_LOSS,
    LossEmbeddings,
    LossScope,
    ModelFamily,
)
from vlfit.models.itm import BridgeTowerForContrastiveLearningWithITM, checkpoint_has_itm_head
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

# ------------------------------------------------------------------------------------------------ embeddings


def text_embeddings(
    model: BridgeTowerForContrastiveLearning, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """L2-normalized text embeddings ``[B, contrastive_hidden_size]``, with gradient (training's hard negatives)."""
    tower = model.bridgetower
    hidden = tower.text_model.embeddings(input_ids=input_ids)
    mask = create_bidirectional_mask(
        config=tower.config, inputs_embeds=hidden[:, 0:1, :], attention_mask=attention_mask
    )
    for layer in tower.text_model.encoder.layer:
        hidden = layer(hidden, mask)
    return nn.functional.normalize(model.itc_text_head(hidden[:, 0, :]), dim=-1, p=2)


encode_text = text_embeddings


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


# ---------------------------------------------------------------------------------------------------- the loss


@dataclass
class ContrastiveOutputWithScale(BridgeTowerContrastiveOutput):
    """``BridgeTowerContrastiveOutput`` plus ``logit_scale`` (the multiplier, ``exp`` of the parameter).

    A declared field rather than an added key: DDP and accelerate rebuild outputs from their fields.
    """

    logit_scale: torch.Tensor | None = None
    itm_logits: torch.Tensor | None = None  # a model with a matching head (vlfit.models.itm)


def _add_logit_scale(module: nn.Module, args: tuple, output: Any) -> ContrastiveOutputWithScale:
    return ContrastiveOutputWithScale(**output, logit_scale=module.logit_scale.exp())


def expose_logit_scale(model: nn.Module) -> None:
    """Make ``model``'s forward return a ``ContrastiveOutputWithScale`` (with ``logit_scale.exp()``).

    The loss computed outside the model needs the scale from inside the forward: DDP (with
    ``find_unused_parameters``) treats a parameter that no forward output depends on as unused and fails when its
    gradient arrives later, and FSDP only holds the unsharded parameter during the forward. Idempotent.

    Args:
        model: A ``BridgeTowerForContrastiveLearning`` (unwrapped from DDP/FSDP).
    """
    install_output_hook(model, _add_logit_scale)


class ContrastiveEmbeddings(NamedTuple):
    """The three embeddings of BridgeTower's loss, named as in its contrastive output."""

    text_embeds: torch.Tensor
    image_embeds: torch.Tensor
    cross_embeds: torch.Tensor


def loss_terms(outputs: Any, symmetric: bool = False, hard_negatives: HardNegatives | None = None) -> list[Term]:
    """BridgeTower's three ``(queries, candidates)`` terms: text->image, text->cross, image->cross; with
    ``symmetric`` or ``hard_negatives``, image->text as a fourth (scored against the hard negatives too)."""
    terms: list[Term] = [
        (outputs.text_embeds, outputs.image_embeds),
        (outputs.text_embeds, outputs.cross_embeds),
        (outputs.image_embeds, outputs.cross_embeds),
    ]
    if symmetric or hard_negatives is not None:
        terms.append((outputs.image_embeds, outputs.text_embeds, hard_negatives))
    return terms


ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def set_attention_implementation(model: BridgeTowerForContrastiveLearning, implementation: str) -> None:
    """Run the text and cross-modal attention eagerly or through ``scaled_dot_product_attention``.

    transformers 5 builds BridgeTower with eager attention only (``_supports_sdpa = False``), and forcing ``sdpa``
    through the config changes the cross-modal embeddings: the cross-modal layers build their self-attention with
    ``is_causal=True``, which eager attention ignores and SDPA honours whenever no mask is passed, as for the
    (never padded) image stream. With ``is_causal`` cleared, SDPA computes what eager computes (the model is an
    encoder; nothing in it is causal), in one fused kernel instead of matmul, softmax and matmul with the scores
    held in memory. The vision tower's ``nn.MultiheadAttention`` is fused either way.
    """
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"unknown --attn_implementation {implementation!r} for BridgeTower; choose one of: "
            f"{', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    for config in (model.config, model.config.text_config):
        config._attn_implementation = implementation  # the attention modules read it at every call
    for module in model.modules():
        if isinstance(module, BridgeTowerSelfAttention):
            module.is_causal = False


def layer_stacks(model: BridgeTowerForContrastiveLearning) -> list[Sequence[nn.Module]]:
    """The transformer blocks of each tower: vision, text, cross-modal text and cross-modal image."""
    tower = model.bridgetower
    return [
        tower.vision_model.visual.transformer.resblocks,
        tower.text_model.encoder.layer,
        tower.cross_modal_text_layers,
        tower.cross_modal_image_layers,
    ]


def contrastive_embeddings(
    unwrapped: BridgeTowerForContrastiveLearning, outputs: Any, inputs: Mapping[str, torch.Tensor]
) -> LossEmbeddings:
    """What the contrastive loss needs of one forward's ``outputs`` (``BridgeTowerFamily.loss_embeddings``; the
    matching objective shares the forward, ``vlfit.models.itm_loss``)."""
    rows = {"text": outputs.text_embeds, "image": outputs.image_embeds, "cross": outputs.cross_embeds}
    # The text tower outside the wrapper's forward: DDP still reduces its gradients once (autograd sums both
    # uses of each parameter before its gradient is ready), and activation checkpointing still applies.
    add_hard_negatives(rows, inputs, lambda ids, mask: text_embeddings(unwrapped, ids, mask))
    add_image_keys(rows, inputs)
    # DataParallel (several GPUs, one process) stacks one copy of the scalar per replica.
    return LossEmbeddings(rows, {"logit_scale": outputs.logit_scale.mean()})


# --------------------------------------------------------------------------------------------------- the family


class BridgeTowerFamily(ModelFamily):
    """``BridgeTowerForContrastiveLearning`` checkpoints and the BridgeTower presets (tiny, small, base, large...)."""

    name = "bridgetower"
    model_types = ("bridgetower",)
    config_class = BridgeTowerConfig

    # saved_image_processor: the default CLIPImageProcessor. BridgeTowerImageProcessor cannot be set to vlfit's
    # resize: it rounds both sides down to a multiple of size_divisor and caps the long side at 1333/800 of the
    # short one (a 16:9 photo then has a short side below the crop). BridgeTowerProcessor takes any image processor,
    # and the model's pixel_mask defaults to the whole image, which is what vlfit feeds it.

    def build(self, config: Any) -> BridgeTowerForContrastiveLearning:
        return BridgeTowerForContrastiveLearning(config)

    def vision_position_embedding(self, model: nn.Module) -> torch.Tensor:
        return model.bridgetower.vision_model.visual.embeddings.position_embedding.weight

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> BridgeTowerForContrastiveLearning:
        # A checkpoint with a matching head (vlfit's with --objective ...itm, the official itm-mlm-itc) keeps it.
        with_itm = checkpoint_has_itm_head(name_or_path, **hub_kwargs)
        model_class = BridgeTowerForContrastiveLearningWithITM if with_itm else BridgeTowerForContrastiveLearning
        return model_class.from_pretrained(name_or_path, **hub_kwargs)

    def image_size(self, config: Any) -> int:
        size = config.vision_config.image_size
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    def module_groups(self) -> dict[str, tuple[str, ...]]:
        cross = ("layers", "transform", "pooler")
        return {
            "text": ("bridgetower.text_model",),
            "vision": ("bridgetower.vision_model",),
            "cross": tuple(f"bridgetower.cross_modal_{side}_{part}" for side in ("text", "image") for part in cross),
        }

    def head_modules(self) -> tuple[str, ...]:
        return ("itc_text_head", "itc_image_head", "itc_cross_modal_head")

    def untrained_modules(self) -> tuple[str, ...]:
        return ("bridgetower.text_model.pooler",)

    def max_text_length(self, config: Any) -> int:
        # RoBERTa's positions start after the padding index (2 of max_position_embeddings are never used).
        return int(config.text_config.max_position_embeddings) - 2

    def set_attention_implementation(self, model: nn.Module, implementation: str) -> None:
        set_attention_implementation(model, implementation)  # type: ignore[arg-type]

    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return encode_text(model, input_ids, attention_mask)  # type: ignore[arg-type]

    def encode_image(self, model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        return encode_image(model, pixel_values)  # type: ignore[arg-type]

    def prepare_for_training(self, model: nn.Module) -> None:
        expose_logit_scale(model)
        # transformers marks BridgeTower as not supporting it; vlfit checkpoints its blocks itself.
        activation_checkpointing.install(model, layer_stacks)  # type: ignore[arg-type]

    def contrastive_loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], scope: LossScope = LOCAL_LOSS
    ) -> torch.Tensor:
        if not (scope.global_negatives or scope.symmetric or HARD_NEGATIVE_INPUT_IDS in inputs or IMAGE_KEYS in inputs
                or under_autocast(inputs["input_ids"])):  # fmt: skip
            model_inputs = {key: inputs[key] for key in self.model_inputs}
            return model(**model_inputs, return_loss=True).loss  # the model's own loss
        return self.loss_from_embeddings(self.loss_embeddings(model, inputs), scope)

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        unwrapped = held_model(model)
        expose_logit_scale(unwrapped)
        outputs = model(**{key: inputs[key] for key in self.model_inputs}, return_loss=False)
        return contrastive_embeddings(unwrapped, outputs, inputs)

    def loss_from_embeddings(self, embeddings: LossEmbeddings, scope: LossScope = LOCAL_LOSS) -> torch.Tensor:
        rows = embeddings.rows
        hard = hard_negatives_in(rows)
        outputs = ContrastiveEmbeddings(rows["text"], rows["image"], rows["cross"])
        terms = loss_terms(outputs, scope.symmetric, hard)
        return info_nce(
            terms, embeddings.shared["logit_scale"], gather=scope.global_negatives, image_keys=image_keys_in(rows)
        )
