"""Tiny random-init checkpoints, saved as ``vlfit train`` saves one."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from vlfit.data.sources import open_splits


def save_tiny_checkpoint(dataset_dir: str, output_dir: Path, seed: int = 0, preset: str = "tiny") -> Path:
    """A random-init checkpoint folder of a (tiny) preset with its tokenizer (trained on the dataset's captions) and
    image processor, as ``vlfit train`` saves one."""
    from vlfit.arguments import ModelArguments
    from vlfit.models.loading import build_model, resolve_model

    args = ModelArguments(model_preset=preset)
    train = open_splits(dataset_name=dataset_dir)["train"]
    spec = resolve_model(**args.source_keywords(), captions=train.captions)
    torch.manual_seed(seed)
    model = build_model(spec, **args.build_keywords())
    model.save_pretrained(output_dir)
    spec.inputs.tokenizer.save_pretrained(output_dir)
    spec.image_processor.save_pretrained(output_dir)
    return output_dir


def write_image_folder(dataset_dir: str, folder: Path) -> Path:
    """The validation and test images of the dataset as JPEG files in two sub-folders, plus one file that is not an
    image (``test/broken.jpg``)."""
    splits = open_splits(dataset_name=dataset_dir)
    for split in ("validation", "test"):
        (folder / split).mkdir(parents=True)
        for record in splits[split]:
            (folder / split / f"{record.id}.jpg").write_bytes(record.image)
    (folder / "test" / "broken.jpg").write_bytes(b"not a jpeg at all")
    return folder


def save_itm_checkpoint(checkpoint: Path, output_dir: Path, seed: int = 2) -> Path:
    """``checkpoint`` with a new matching head (initialized as transformers does), saved as vlfit train saves a run
    of ``--objective contrastive+itm``."""
    from transformers import BridgeTowerForContrastiveLearning

    from vlfit.models.itm import with_itm_head

    model = BridgeTowerForContrastiveLearning.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    with_itm_head(model).save_pretrained(output_dir)
    for path in checkpoint.iterdir():  # the tokenizer and image processor
        if not (output_dir / path.name).exists():
            shutil.copy(path, output_dir / path.name)
    return output_dir
