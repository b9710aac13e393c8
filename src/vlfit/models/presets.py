"""Architecture presets for BridgeTower: real checkpoints' shapes, built with random weights (no hub needed)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import BridgeTowerConfig

# CLIP's pixel statistics: BridgeTower's vision tower is CLIP's, and its image processor uses them.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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


def get_preset(name: str) -> BridgeTowerPreset:
    """Look a preset up by name.

    Raises:
        ValueError: naming the unknown preset and listing the valid ones.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown --model_preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def preset_config(name: str) -> BridgeTowerConfig:
    """Build the ``BridgeTowerConfig`` of a preset.

    ``contrastive_hidden_size`` and ``logit_scale_init_value`` are passed explicitly: transformers 5 does not
    fill them in from defaults for a config built from parts.
    """
    p = get_preset(name)
    return BridgeTowerConfig(
        text_config={
            "vocab_size": p.vocab_size,
            "hidden_size": p.text_hidden,
            "num_hidden_layers": p.text_layers,
            "num_attention_heads": p.text_heads,
            "intermediate_size": p.text_intermediate,
            "max_position_embeddings": p.max_positions,
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
