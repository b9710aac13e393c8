"""SigLIP 2 with NaFlex: any ``transformers.Siglip2Model`` checkpoint and the ``siglip2-*`` presets.

SigLIP 2 comes in two kinds. The FixRes checkpoints (``google/siglip2-base-patch16-224`` ...) are ``SiglipModel``s
(``model_type`` ``siglip``) and load as SigLIP (``vlfit.models.siglip``). The NaFlex ones (``model_type``
``siglip2``) keep each image's aspect ratio: an image is at most ``max_num_patches`` patches of ``patch_size``
pixels (the token budget, 256 by default), and a batch carries, beside its padded patches, a
``pixel_attention_mask`` (which rows are patches) and ``spatial_shapes`` (each image's patch rows and columns).
The input pipeline makes them in the loader workers (``vlfit.data.naflex``); this module is the model's side.

The text tower, the sigmoid loss and its initial temperature and bias are SigLIP's, and so is everything that
depends on them (captions padded to the positions without a mask; ``vlfit.models.siglip``). The run's token
budget is part of its input spec (``--max_num_patches``, recorded in ``input_spec.json``), and the saved
``Siglip2ImageProcessor`` carries it, so plain transformers resizes as vlfit does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model

from vlfit.errors import ConfigError
from vlfit.models.dual_encoder import normalized
from vlfit.models.family import InputSpec, LossEmbeddings
from vlfit.models.logit_scale import install_output_hook
from vlfit.models.losses import add_hard_negatives, add_image_keys
from vlfit.models.siglip import SiglipFamily, _add_scale_and_bias, text_embeddings, text_inputs
from vlfit.models.unwrap import held_model

# Siglip2ImageProcessor's default budget and resampling (PIL's BILINEAR).
DEFAULT_MAX_NUM_PATCHES = 256
BILINEAR = 2


def naflex_image_inputs(
    pixel_values: torch.Tensor,
    pixel_attention_mask: torch.Tensor | None,
    spatial_shapes: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The vision tower's keywords, refusing square images in one line (what a caller that makes square pixels
    instead of ``vlfit.data.image_inputs``' batches would hand it)."""
    if pixel_attention_mask is None or spatial_shapes is None or pixel_values.dim() != 3:
        raise ConfigError(
            "a SigLIP 2 NaFlex model takes each image as patches with their mask and grids, and this command only "
            f"makes square images ({tuple(pixel_values.shape)}); embed with vlfit.load, retrieve or serve instead"
        )
    return {"pixel_values": pixel_values, "pixel_attention_mask": pixel_attention_mask,
            "spatial_shapes": spatial_shapes}  # fmt: skip


class Siglip2Family(SiglipFamily):
    """``Siglip2Model`` (NaFlex) checkpoints and the ``siglip2-*`` presets."""

    name = "siglip2"
    model_types = ("siglip2",)
    config_class = Siglip2Config
    vision_class_token = False
    model_inputs = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "spatial_shapes")

    def saved_image_processor(self, inputs: InputSpec) -> Siglip2ImageProcessor:
        # What vlfit.data.naflex does, as the processor's settings: the same grid, bilinear resize, normalization.
        return Siglip2ImageProcessor(
            patch_size=inputs.patch_size,
            max_num_patches=inputs.max_num_patches,
            resample=BILINEAR,
            do_convert_rgb=True,
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=True,
            image_mean=list(inputs.image_mean),
            image_std=list(inputs.image_std),
        )

    def max_num_patches(self, image_processor: Any) -> int | None:
        return int(getattr(image_processor, "max_num_patches", None) or DEFAULT_MAX_NUM_PATCHES)

    @contextlib.contextmanager
    def export_context(self) -> Iterator[None]:
        # Siglip2VisionEmbeddings asserts that each grid is positive and within the patch count (aten._is_all_true,
        # which no ONNX function converts); vlfit's grids are so by construction (vlfit.data.naflex).
        from transformers.models.siglip2 import modeling_siglip2

        check = modeling_siglip2.torch_compilable_check
        modeling_siglip2.torch_compilable_check = lambda *args, **kwargs: None
        try:
            yield
        finally:
            modeling_siglip2.torch_compilable_check = check

    def build(self, config: Any) -> Siglip2Model:
        return Siglip2Model(config)

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> Siglip2Model:
        return Siglip2Model.from_pretrained(name_or_path, **hub_kwargs)

    def image_size(self, config: Any) -> int:
        """The side of the square the position embeddings' grid covers (NaFlex resizes that grid per image)."""
        vision = config.vision_config
        return math.isqrt(int(vision.num_patches)) * int(vision.patch_size)

    def encode_image(
        self,
        model: nn.Module,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = naflex_image_inputs(pixel_values, pixel_attention_mask, spatial_shapes)
        return normalized(model.get_image_features(**inputs).pooler_output)  # type: ignore[operator]

    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return text_embeddings(model, input_ids, attention_mask)  # type: ignore[arg-type]

    def loss_embeddings(self, model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> LossEmbeddings:
        unwrapped = held_model(model)
        install_output_hook(unwrapped, _add_scale_and_bias)
        text = text_inputs(unwrapped.config, inputs["input_ids"], inputs["attention_mask"])
        images = naflex_image_inputs(
            inputs["pixel_values"], inputs.get("pixel_attention_mask"), inputs.get("spatial_shapes")
        )
        outputs = model(**text, **images, return_loss=False)
        rows = {"text": outputs.text_embeds, "image": outputs.image_embeds}
        add_hard_negatives(rows, inputs, lambda ids, mask: text_embeddings(unwrapped, ids, mask))
        add_image_keys(rows, inputs)
        shared = {"logit_scale": outputs.logit_scale.mean(), "logit_bias": outputs.logit_bias.mean()}
        return LossEmbeddings(rows, shared)
