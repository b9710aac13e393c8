"""``ModelArguments``: which model a command loads (a checkpoint, LoRA adapters or a preset), what it freezes and
how it trains (LoRA); converted at the CLI's edge into the keyword arguments ``vlfit.models.loading`` takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.flags import flag
from vlfit.models.presets import list_presets
from vlfit.models.reference import two_towers

if TYPE_CHECKING:
    from vlfit.models.lora import LoraSettings


# What --freeze names (each family's module_groups says which it has).
TOWERS = ("text", "vision", "cross")


@dataclass
class ModelArguments:
    """Which model to fine-tune, and what to freeze."""

    model_name_or_path: str | None = flag(
        None,
        "A checkpoint of a supported model family (BridgeTower, CLIP, MetaCLIP 2, SigLIP, SigLIP 2, or a "
        "model of two towers a vlfit run saved), or a folder of LoRA adapters a vlfit run saved: a local folder or "
        "a hub id.",
    )
    model_preset: str | None = flag(
        None,
        f"Build a model with random weights instead: one of {', '.join(list_presets())}, or the path "
        "of a preset .json file (written as the shipped ones in vlfit/models/presets/ are). "
        "A byte-level BPE tokenizer is trained on the training captions unless --tokenizer_name is given.",
    )
    vision_model_name_or_path: str | None = flag(
        None,
        "With --text_model_name_or_path, instead of a checkpoint or preset: a CLIP-like model of two "
        "pretrained towers joined by new projections (transformers' VisionTextDualEncoderModel, run_clip.py's "
        "first example): this is the vision tower, any model AutoModel loads that takes pixels (ViT, a CLIP "
        "checkpoint's vision tower, DINOv2, ConvNeXt ...); its image processor's size, mean and std become the "
        "run's. A folder or a hub id.",
    )
    text_model_name_or_path: str | None = flag(
        None,
        "The text tower of a model of two towers (see --vision_model_name_or_path): BERT, RoBERTa, "
        "MiniLM ...; its tokenizer is the run's. A folder or a hub id.",
    )
    projection_dim: int | None = flag(
        None,
        "A model of two towers: the size of the shared embedding space its new projections map "
        "both towers into (default 512).",
    )
    lock_image_tower: bool = flag(
        False,
        "Do not train the vision tower (LiT's locked-image tuning; the same as --freeze vision): "
        "the text tower and the projections learn to match it.",
    )
    lock_text_tower: bool = flag(False, "Do not train the text tower (the same as --freeze text).")
    tokenizer_name: str | None = flag(None, "Tokenizer to use instead of the model's.")
    image_processor_name: str | None = flag(None, "Image processor (mean, std) to use instead of the model's.")
    cache_dir: str | None = flag(None, "Where downloaded models and datasets are cached.")
    model_revision: str = flag("main", "Model branch, tag or commit.")
    token: str | None = flag(None, "Hub token for private models or datasets.")
    freeze_vision_model: bool = flag(False, "Do not train the vision encoder.")
    freeze_text_model: bool = flag(False, "Do not train the text encoder.")
    freeze: str | None = flag(
        None,
        "Comma-separated towers not to train: text, vision, cross (BridgeTower's cross-modal layers). "
        "--freeze vision is open_clip's locked-image tuning; --freeze_vision_model / --freeze_text_model "
        "(run_clip.py's and run_bridgetower.py's) add to it.",
    )
    unfreeze_after_steps: int | None = flag(
        None,
        "Train the towers --freeze (or --freeze_*_model) froze after this many optimizer steps (they "
        "are in the optimizer from the start, without gradients until then). One process only.",
    )
    freeze_text_pooler: bool = flag(True, "Do not train the text pooler (the contrastive loss never reaches it).")
    attn_implementation: str = flag(
        "sdpa",
        "Attention kernel: sdpa (PyTorch's fused scaled_dot_product_attention) or eager (matmul, "
        "softmax, matmul). For BridgeTower, whose transformers class runs its text and cross-modal attention "
        "eagerly only, vlfit supplies the sdpa path (equal to eager within float tolerance).",
    )
    logit_scale_init_value: float | None = flag(
        None,
        "Start training with the model's logit scale (the log of the inverse temperature: its exp "
        "multiplies the similarities of the contrastive loss) at this value, instead of the checkpoint's or "
        "the config's (BridgeTower, CLIP: ln(1/0.07) = 2.659). For models with a logit_scale parameter.",
    )
    lora_r: int | None = flag(
        None,
        "Fine-tune LoRA adapters of this rank (through peft) instead of every weight: the adapters and "
        "the projection heads train, the rest stays; the run saves the adapters only (vlfit merge-lora makes "
        "a plain checkpoint of them).",
    )
    lora_alpha: float | None = flag(None, "LoRA scaling numerator (default 2 * r).")
    lora_dropout: float = flag(0.0, "Dropout on the LoRA adapters' input.")
    lora_target: str | None = flag(
        None,
        "Comma-separated: towers (text, vision, cross: BridgeTower's cross-modal layers) or linear module "
        "names (query, v_proj, ...). Default: every tower.",
    )
    config_name: str | None = flag(None, "Pretrained config name or path, if not the same as --model_name_or_path.")
    use_fast_tokenizer: bool = flag(
        True,
        "Use a fast tokenizer (backed by the tokenizers library). transformers 5 always does, so "
        "--no_use_fast_tokenizer changes nothing.",
    )
    trust_remote_code: bool = flag(
        False,
        "Trust the execution of code from models defined on the Hub. Only set this for repositories "
        "you trust and whose code you have read: it runs that code on your machine.",
    )

    def __post_init__(self) -> None:
        two_towers(self.model_name_or_path, self.model_preset, self.vision_model_name_or_path,
                   self.text_model_name_or_path, self.projection_dim)  # fmt: skip
        if self.model_preset is not None:
            from vlfit.models.registry import family_for_preset

            family_for_preset(self.model_preset)  # an unknown name fails here, before any data is opened
        unknown = sorted(set(self.frozen_towers()) - set(TOWERS))
        if unknown:
            raise ConfigError(f"--freeze {','.join(unknown)}: unknown tower; choose from {', '.join(TOWERS)}")
        if self.unfreeze_after_steps is not None:
            if not self.frozen_towers():
                raise ConfigError("--unfreeze_after_steps needs a frozen tower (--freeze text|vision|cross)")
            if int(self.unfreeze_after_steps) < 1:
                raise ConfigError(f"--unfreeze_after_steps must be at least 1, got {self.unfreeze_after_steps}")
            if self.lora_r is not None:
                raise ConfigError("--unfreeze_after_steps with --lora_r: LoRA trains its adapters only; drop one")
        if self.lora_r is not None:
            require_extra("lora", "--lora_r (LoRA adapters)")
        if self.lora_r is not None and int(self.lora_r) < 1:
            raise ConfigError(f"--lora_r must be at least 1, got {self.lora_r}")
        if self.lora_r is None and (self.lora_target or self.lora_alpha is not None):
            raise ConfigError("--lora_target and --lora_alpha need --lora_r (the adapters' rank)")

    def frozen_towers(self) -> tuple[str, ...]:
        """The towers ``--freeze``, ``--freeze_vision_model`` / ``--freeze_text_model`` and ``--lock_image_tower`` /
        ``--lock_text_tower`` name."""
        towers = [t.strip() for t in (self.freeze or "").split(",") if t.strip()]
        flags = (("vision", self.freeze_vision_model), ("text", self.freeze_text_model),
                 ("vision", self.lock_image_tower), ("text", self.lock_text_tower))  # fmt: skip
        towers += [name for name, on in flags if on]
        return tuple(dict.fromkeys(towers))

    def source_keywords(self) -> dict[str, Any]:
        """Which model and the hub settings, as ``vlfit.models.loading.resolve_model`` takes them (keywords: the
        models layer never reads this dataclass)."""
        return {
            "model_name_or_path": self.model_name_or_path,
            "model_preset": self.model_preset,
            "config_name": self.config_name,
            "tokenizer_name": self.tokenizer_name,
            "image_processor_name": self.image_processor_name,
            "cache_dir": self.cache_dir,
            "model_revision": self.model_revision,
            "token": self.token,
            "trust_remote_code": self.trust_remote_code,
            "vision_model_name_or_path": self.vision_model_name_or_path,
            "text_model_name_or_path": self.text_model_name_or_path,
            "projection_dim": self.projection_dim,
        }

    def build_keywords(self) -> dict[str, Any]:
        """The attention kernel and frozen towers, as ``vlfit.models.loading.build_model`` takes them."""
        return {
            "attn_implementation": self.attn_implementation,
            "frozen_towers": self.frozen_towers(),
            "freeze_text_pooler": self.freeze_text_pooler,
        }

    def lora_settings(self) -> LoraSettings | None:
        """The LoRA flags, or None without ``--lora_r``."""
        if self.lora_r is None:
            return None
        from vlfit.models.lora import LoraSettings

        targets = tuple(t.strip() for t in (self.lora_target or "").split(",") if t.strip())
        return LoraSettings(int(self.lora_r), self.lora_alpha, float(self.lora_dropout), targets)
