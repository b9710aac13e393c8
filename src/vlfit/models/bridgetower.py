"""BridgeTower: presets with the real checkpoints' shapes, unimodal embeddings, and its contrastive loss.

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
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning, BridgeTowerImageProcessor
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
from vlfit.models.position_embeddings import init_vit_position_embedding


@dataclass(frozen=True)
class BridgeTowerPreset:
    """Sizes of one BridgeTower architecture.

    The unimodal encoders must have at least ``cross_layers`` layers: BridgeTower bridges their top
    ``cross_layers`` layers into the cross-modal encoder. Vision attention heads are ``vision_hidden // 64``.
    """

    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    vocab_size: int
    max_positions: int
    vision_hidden: int
    vision_layers: int
    patch_size: int
    image_size: int
    cross_hidden: int
    cross_layers: int
    cross_heads: int
    contrastive_hidden: int = 512
    logit_scale_init_value: float = 2.6592
    dropout: float = 0.1  # of the text and cross-modal layers (hidden states and attention weights)
    # Initial vision position embeddings: "random" (transformers' init) or "sincos" (2D sine-cosine, see
    # vlfit.models.position_embeddings); for models trained from scratch, which must otherwise learn where patches are.
    vision_position_init: str = "random"
    tokenizer_vocab_size: int | None = None  # size of the BPE trained for this preset when no tokenizer is given


PRESETS: dict[str, BridgeTowerPreset] = {
    # A few hundred thousand parameters: a training step in well under a second on one CPU core.
    "tiny": BridgeTowerPreset(
        text_hidden=64, text_layers=2, text_heads=2, text_intermediate=128, vocab_size=1024, max_positions=130,
        vision_hidden=64, vision_layers=2, patch_size=16, image_size=64,
        cross_hidden=64, cross_layers=2, cross_heads=2, contrastive_hidden=64, tokenizer_vocab_size=1024,
    ),
    # Learns the synthetic captioned dataset in a few CPU minutes (`make demo`).
    "small": BridgeTowerPreset(
        text_hidden=192, text_layers=4, text_heads=4, text_intermediate=768, vocab_size=4096, max_positions=130,
        vision_hidden=192, vision_layers=4, patch_size=16, image_size=128,
        cross_hidden=192, cross_layers=2, cross_heads=4, contrastive_hidden=128, tokenizer_vocab_size=4096,
        dropout=0.0,  # trained from scratch for a few hundred steps, it underfits: dropout only slowed it down
        vision_position_init="sincos",  # learned faster than random ones (docs/demo-recipe.md)
    ),
    # `small` with 8-pixel patches at 80 px: a 10x10 grid of finer patches for the same width and depth. What
    # `make demo` trains: it tells where objects are, which 16-pixel patches at 128 px never learned in the
    # demo's steps (docs/demo-recipe.md).
    "small-p8": BridgeTowerPreset(
        text_hidden=192, text_layers=4, text_heads=4, text_intermediate=768, vocab_size=4096, max_positions=130,
        vision_hidden=192, vision_layers=4, patch_size=8, image_size=80,
        cross_hidden=192, cross_layers=2, cross_heads=4, contrastive_hidden=128, tokenizer_vocab_size=4096,
        dropout=0.0, vision_position_init="sincos",
    ),
    # ViT-B/16 at 288 with RoBERTa-base text: the shapes of BridgeTower/bridgetower-base.
    "base": BridgeTowerPreset(
        text_hidden=768, text_layers=12, text_heads=12, text_intermediate=3072, vocab_size=50265, max_positions=514,
        vision_hidden=768, vision_layers=12, patch_size=16, image_size=288,
        cross_hidden=768, cross_layers=6, cross_heads=12,
    ),
    # The shapes of BridgeTower/bridgetower-large-itm-mlm-itc (about 866M parameters).
    "large": BridgeTowerPreset(
        text_hidden=1024, text_layers=24, text_heads=16, text_intermediate=4096, vocab_size=50265, max_positions=514,
        vision_hidden=1024, vision_layers=24, patch_size=14, image_size=294,
        cross_hidden=1024, cross_layers=6, cross_heads=16,
    ),
}  # fmt: skip


def preset_config(name: str) -> BridgeTowerConfig:
    """Build the ``BridgeTowerConfig`` of a preset.

    ``contrastive_hidden_size`` and ``logit_scale_init_value`` are passed explicitly: transformers 5 does not
    fill them in from defaults for a config built from parts.
    """
    p = PRESETS[name]
    return BridgeTowerConfig(
        text_config={
            "vocab_size": p.vocab_size,
            "hidden_size": p.text_hidden,
            "num_hidden_layers": p.text_layers,
            "num_attention_heads": p.text_heads,
            "intermediate_size": p.text_intermediate,
            "max_position_embeddings": p.max_positions,
            "hidden_dropout_prob": p.dropout,
            "attention_probs_dropout_prob": p.dropout,
        },
        vision_config={
            "hidden_size": p.vision_hidden,
            "num_hidden_layers": p.vision_layers,
            "patch_size": p.patch_size,
            "image_size": p.image_size,
        },
        hidden_size=p.cross_hidden,
        num_hidden_layers=p.cross_layers,
        num_attention_heads=p.cross_heads,
        contrastive_hidden_size=p.contrastive_hidden,
        logit_scale_init_value=p.logit_scale_init_value,
    )


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


# --------------------------------------------------------------------------------------------------- the family


class BridgeTowerFamily(ModelFamily):
    """``BridgeTowerForContrastiveLearning`` checkpoints and the presets above."""

    name = "bridgetower"
    model_types = ("bridgetower",)

    def preset_names(self) -> tuple[str, ...]:
        return tuple(PRESETS)

    def preset_config(self, preset: str) -> BridgeTowerConfig:
        return preset_config(preset)

    def preset_tokenizer_vocab_size(self, preset: str) -> int:
        p = PRESETS[preset]
        return p.tokenizer_vocab_size or p.vocab_size

    def preset_image_processor(self, preset: str) -> BridgeTowerImageProcessor:
        size = PRESETS[preset].image_size
        return BridgeTowerImageProcessor(
            size={"shortest_edge": size},
            crop_size={"shortest_edge": size},
            image_mean=list(OPENAI_CLIP_MEAN),
            image_std=list(OPENAI_CLIP_STD),
        )

    # saved_image_processor: the default CLIPImageProcessor. BridgeTowerImageProcessor cannot be set to vlfit's
    # resize: it rounds both sides down to a multiple of size_divisor and caps the long side at 1333/800 of the
    # short one (a 16:9 photo then has a short side below the crop). BridgeTowerProcessor takes any image processor,
    # and the model's pixel_mask defaults to the whole image, which is what vlfit feeds it.

    def build(self, config: Any) -> BridgeTowerForContrastiveLearning:
        return BridgeTowerForContrastiveLearning(config)

    def initialize_preset(self, model: nn.Module, preset: str) -> None:
        position_init = PRESETS[preset].vision_position_init
        if position_init == "sincos":
            embeddings = model.bridgetower.vision_model.visual.embeddings
            init_vit_position_embedding(embeddings.position_embedding.weight, class_token=True)
        elif position_init != "random":
            raise ConfigError(f"preset {preset}: unknown vision_position_init {position_init!r} (random or sincos)")

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> BridgeTowerForContrastiveLearning:
        return BridgeTowerForContrastiveLearning.from_pretrained(name_or_path, **hub_kwargs)

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
        self,
        model: nn.Module,
        inputs: Mapping[str, torch.Tensor],
        *,
        global_negatives: bool = False,
        symmetric: bool = False,
    ) -> torch.Tensor:
        if not (global_negatives or symmetric or HARD_NEGATIVE_INPUT_IDS in inputs or IMAGE_KEYS in inputs):
            model_inputs = {key: inputs[key] for key in self.model_inputs}
            return model(**model_inputs, return_loss=True).loss  # the model's own loss
        return self.loss_from_embeddings(
            self.loss_embeddings(model, inputs), global_negatives=global_negatives, symmetric=symmetric
        )

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        unwrapped = extract_model_from_parallel(model)
        expose_logit_scale(unwrapped)
        outputs = model(**{key: inputs[key] for key in self.model_inputs}, return_loss=False)
        rows = {"text": outputs.text_embeds, "image": outputs.image_embeds, "cross": outputs.cross_embeds}
        # The text tower outside the wrapper's forward: DDP still reduces its gradients once (autograd sums both
        # uses of each parameter before its gradient is ready), and activation checkpointing still applies.
        add_hard_negatives(rows, inputs, lambda ids, mask: text_embeddings(unwrapped, ids, mask))
        add_image_keys(rows, inputs)
        # DataParallel (several GPUs, one process) stacks one copy of the scalar per replica.
        return LossEmbeddings(rows, {"logit_scale": outputs.logit_scale.mean()})

    def loss_from_embeddings(
        self, embeddings: LossEmbeddings, *, global_negatives: bool = False, symmetric: bool = False
    ) -> torch.Tensor:
        rows = embeddings.rows
        hard = hard_negatives_in(rows)
        outputs = ContrastiveEmbeddings(rows["text"], rows["image"], rows["cross"])
        terms = loss_terms(outputs, symmetric, hard)
        return info_nce(
            terms, embeddings.shared["logit_scale"], gather=global_negatives, image_keys=image_keys_in(rows)
        )
