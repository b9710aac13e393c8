"""Two towers: a CLIP-like dual encoder made of any pretrained vision tower and any pretrained text tower
(transformers' ``VisionTextDualEncoderModel``, the model of ``run_clip.py``'s first example), and the
``two-tower-*`` presets.

Built from ``--vision_model_name_or_path`` (a ViT, a CLIP vision tower, DINOv2, ConvNeXt: anything ``AutoModel``
loads and whose output has a ``pooler_output``) and ``--text_model_name_or_path`` (BERT, RoBERTa, MiniLM ...), with
new projections into a shared space of ``--projection_dim`` and a learnable logit scale. Its inputs are the towers'
own: the text tower's tokenizer, the vision tower's image processor (size, mean, std), so that each tower sees what
it was pretrained on. ``--freeze vision`` (or ``--lock_image_tower``) is LiT's locked-image tuning: the projections
train, the tower does not.

The loss, embeddings and heads are CLIP's (the same ``get_text_features`` / ``get_image_features`` and ``CLIPOutput``),
so the family is ``CLIPFamily`` with another model class; a saved run is a plain ``VisionTextDualEncoderModel``
folder.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import VisionTextDualEncoderConfig, VisionTextDualEncoderModel

from vlfit.errors import ConfigError, ModelLoadError, first_line
from vlfit.models.clip import CLIPFamily

# Where a tower's projection starts when the flags do not say (run_clip.py's examples: 512).
DEFAULT_PROJECTION_DIM = 512


def processor_image_size(image_processor: Any) -> int | None:
    """The side of the square a transformers image processor feeds its model: its crop when it crops, else its
    resize target (``{"height", "width"}`` or ``{"shortest_edge"}``); None when it says neither."""
    sizes = []
    if getattr(image_processor, "do_center_crop", False):
        sizes.append(getattr(image_processor, "crop_size", None))
    sizes.append(getattr(image_processor, "size", None))
    for size in sizes:
        if isinstance(size, int):
            return size
        if isinstance(size, dict):
            side = size.get("height") or size.get("shortest_edge")
            if side:
                return int(side)
    return None


class TwoTowerFamily(CLIPFamily):
    """``VisionTextDualEncoderModel`` checkpoints, models made of two pretrained towers, and the ``two-tower-*``
    presets."""

    stretches_text_positions = False  # a BERT-like tower: its own (512) positions

    name = "two-tower"
    model_types = ("vision-text-dual-encoder",)
    config_class = VisionTextDualEncoderConfig
    model_class = VisionTextDualEncoderModel
    vision_class_token = True

    def from_towers(
        self, vision: str, text: str, *, projection_dim: int, hub: dict[str, Any]
    ) -> VisionTextDualEncoderModel:
        """A model of the pretrained towers ``vision`` and ``text`` (folders or hub ids, loaded with ``hub``'s
        settings) joined by new projections of ``projection_dim``; a CLIP checkpoint's vision tower is its
        ``CLIPVisionModel``, as transformers' ``from_vision_text_pretrained`` takes it."""
        vision_model = _load_tower(vision, "--vision_model_name_or_path", hub, vision=True)
        text_model = _load_tower(text, "--text_model_name_or_path", hub, vision=False)
        config = VisionTextDualEncoderConfig.from_vision_text_configs(
            vision_model.config, text_model.config, projection_dim=projection_dim
        )
        return VisionTextDualEncoderModel(config, vision_model=vision_model, text_model=text_model)

    def image_size(self, config: Any) -> int:
        size = getattr(config.vision_config, "image_size", None)
        return int(size) if size is not None else 224

    def input_image_size(self, config: Any, image_processor: Any) -> int:
        """The image processor's square (the tower was pretrained at it; a saved run's processor is vlfit's own at
        the run's size), else the tower's config's."""
        return processor_image_size(image_processor) or self.image_size(config)

    def patch_size(self, config: Any) -> int | None:
        size = getattr(config.vision_config, "patch_size", None)
        # a convolutional tower's stem (ConvNeXt's 4) is no constraint on the image's side
        return int(size) if size is not None and hasattr(config.vision_config, "num_attention_heads") else None

    def vision_position_embedding(self, model: nn.Module) -> Any:
        embeddings = model.vision_model.embeddings  # type: ignore[union-attr]
        if hasattr(embeddings, "position_embedding"):  # CLIP's vision tower: an nn.Embedding
            return embeddings.position_embedding.weight
        if hasattr(embeddings, "position_embeddings"):  # ViT, DINOv2: a [1, positions, width] parameter
            return embeddings.position_embeddings.data[0]
        raise NotImplementedError(f"{type(model.vision_model).__name__} has no position embeddings vlfit knows")


def tower_config(name_or_path: str, flag: str, hub: dict[str, Any], *, vision: bool) -> Any:
    """The config of one pretrained tower (a CLIP checkpoint's vision tower: its ``vision_config``), or one line
    naming ``flag`` and what is wrong with it: no such folder, not a model, not a tower of that kind."""
    from transformers import AutoConfig

    from vlfit.models.reference import check_local_path

    check_local_path(name_or_path, flag)
    try:
        config = AutoConfig.from_pretrained(name_or_path, **hub)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(
            f"{flag} {name_or_path}: cannot load a model config ({first_line(error, 200)}); pass a folder saved with "
            "save_pretrained or a hub id"
        ) from error
    if vision and config.model_type == "clip":
        return config.vision_config
    kind = config.model_type
    if vision and not hasattr(config, "num_channels"):
        raise ConfigError(f"{flag} {name_or_path}: a {kind} model is not a vision tower (it takes no pixels)")
    if not vision and not (hasattr(config, "vocab_size") and not hasattr(config, "num_channels")):
        raise ConfigError(f"{flag} {name_or_path}: a {kind} model is not a text tower (it has no vocabulary)")
    return config


def _load_tower(name_or_path: str, flag: str, hub: dict[str, Any], *, vision: bool) -> nn.Module:
    """One pretrained tower's weights (its config as ``tower_config`` reads it)."""
    from transformers import AutoModel, CLIPVisionModel

    config = tower_config(name_or_path, flag, hub, vision=vision)
    try:
        if config.model_type == "clip_vision_model":
            return CLIPVisionModel.from_pretrained(name_or_path, config=config, **hub)
        return AutoModel.from_pretrained(name_or_path, config=config, **hub)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(
            f"{flag} {name_or_path}: cannot load its weights ({first_line(error, 200)}); pass a folder saved with "
            "save_pretrained or a hub id"
        ) from error
