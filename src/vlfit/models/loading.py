"""Load a BridgeTower checkpoint (local folder or hub id) or build a preset, with its tokenizer and image processor."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    BridgeTowerForContrastiveLearning,
    BridgeTowerImageProcessor,
    PreTrainedTokenizerBase,
)

from vlfit.models.presets import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, get_preset, preset_config
from vlfit.models.tokenizer import train_caption_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ModelBundle:
    """A model with everything that defines its inputs: the single place image size, mean and std come from."""

    model: BridgeTowerForContrastiveLearning
    tokenizer: PreTrainedTokenizerBase
    image_processor: Any

    @property
    def image_size(self) -> int:
        size = self.model.config.vision_config.image_size
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    @property
    def image_mean(self) -> tuple[float, float, float]:
        return tuple(float(x) for x in self.image_processor.image_mean)  # type: ignore[return-value]

    @property
    def image_std(self) -> tuple[float, float, float]:
        return tuple(float(x) for x in self.image_processor.image_std)  # type: ignore[return-value]

    def save_pretrained(self, output_dir: str) -> None:
        """Save model, tokenizer and image processor so ``--model_name_or_path output_dir`` loads all three."""
        self.model.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)
        self.image_processor.save_pretrained(output_dir)


def load_model_bundle(
    *,
    model_name_or_path: str | None,
    model_preset: str | None,
    tokenizer_name: str | None = None,
    image_processor_name: str | None = None,
    cache_dir: str | None = None,
    model_revision: str | None = None,
    token: str | None = None,
    captions: Callable[[], Iterable[str | None]] | None = None,
    max_seq_length: int = 128,
    freeze_vision_model: bool = False,
    freeze_text_model: bool = False,
    freeze_text_pooler: bool = True,
) -> ModelBundle:
    """Load a checkpoint with ``from_pretrained`` or build a preset with random weights.

    Args:
        model_name_or_path: Local folder or hub id of a ``BridgeTowerForContrastiveLearning`` checkpoint.
        model_preset: One of ``tiny|small|base|large`` (random init); exclusive with ``model_name_or_path``.
        tokenizer_name: A tokenizer to load instead of the checkpoint's (or instead of training one for a preset).
        image_processor_name: An image processor to load instead of the checkpoint's.
        cache_dir: ``from_pretrained`` cache folder.
        model_revision: Branch, tag or commit of the checkpoint.
        token: Hub token.
        captions: Returns the training captions; a preset without ``tokenizer_name`` trains its tokenizer on them.
        max_seq_length: Longest tokenized caption.
        freeze_vision_model: Disable gradients of the vision encoder.
        freeze_text_model: Disable gradients of the text encoder.
        freeze_text_pooler: Disable gradients of the text pooler. The contrastive loss never reaches it, and
            DistributedDataParallel fails on parameters without gradients, so this defaults to on.
    """
    if (model_name_or_path is None) == (model_preset is None):
        raise ValueError(
            "pass exactly one of --model_name_or_path (a checkpoint folder or hub id) or --model_preset "
            f"(random init; one of: tiny, small, base, large); got model_name_or_path={model_name_or_path!r}, "
            f"model_preset={model_preset!r}"
        )
    hub_kwargs = {"cache_dir": cache_dir, "revision": model_revision, "token": token}
    if model_name_or_path is not None:
        model = BridgeTowerForContrastiveLearning.from_pretrained(model_name_or_path, **hub_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or model_name_or_path, **hub_kwargs)
        image_processor = AutoImageProcessor.from_pretrained(image_processor_name or model_name_or_path, **hub_kwargs)
    else:
        preset = get_preset(model_preset)  # type: ignore[arg-type]
        model = BridgeTowerForContrastiveLearning(preset_config(model_preset))  # type: ignore[arg-type]
        if tokenizer_name is not None:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, **hub_kwargs)
        else:
            if captions is None:
                raise ValueError(f"preset {model_preset!r} needs training captions or --tokenizer_name")
            logger.info("training a byte-level BPE tokenizer on the training captions (no --tokenizer_name given)")
            tokenizer = train_caption_tokenizer(
                captions(), vocab_size=preset.tokenizer_vocab_size or preset.vocab_size, model_max_length=max_seq_length
            )
        if len(tokenizer) > preset.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but preset {model_preset!r} embeds only {preset.vocab_size}"
            )
        if image_processor_name is not None:
            image_processor = AutoImageProcessor.from_pretrained(image_processor_name, **hub_kwargs)
        else:
            image_processor = BridgeTowerImageProcessor(
                size={"shortest_edge": preset.image_size},
                crop_size={"shortest_edge": preset.image_size},
                image_mean=list(OPENAI_CLIP_MEAN),
                image_std=list(OPENAI_CLIP_STD),
            )
    _freeze(model, vision=freeze_vision_model, text=freeze_text_model, text_pooler=freeze_text_pooler)
    return ModelBundle(model=model, tokenizer=tokenizer, image_processor=image_processor)


def _freeze(model: BridgeTowerForContrastiveLearning, *, vision: bool, text: bool, text_pooler: bool) -> None:
    # Freezing (rather than deleting the pooler as some scripts do) keeps saved checkpoints complete.
    tower = model.bridgetower
    if vision:
        tower.vision_model.requires_grad_(False)
    if text:
        tower.text_model.requires_grad_(False)
    pooler = getattr(tower.text_model, "pooler", None)
    if text_pooler and pooler is not None:
        pooler.requires_grad_(False)
