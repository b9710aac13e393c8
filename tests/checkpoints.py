"""A tiny checkpoint folder as a fine-tuning run leaves it (model, tokenizer, image processor), for loading tests."""

from __future__ import annotations

from vlfit.models.loading import LoadedModel, load_model

CAPTIONS = ["two red circles on the left", "one blue square at the top", "three green crosses"] * 10


def save_bundle(bundle: LoadedModel, path: str) -> str:
    """Write what ``vlfit train`` writes into its output folder; returns ``path``."""
    bundle.model.save_pretrained(path)
    bundle.tokenizer.save_pretrained(path)
    bundle.image_processor.save_pretrained(path)
    return path


def save_tiny_checkpoint(path: str) -> str:
    """A random-init tiny preset saved as a checkpoint at ``path``; returns ``path``."""
    return save_bundle(load_model(model_preset="tiny", captions=lambda: CAPTIONS), path)
