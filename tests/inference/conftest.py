"""Fixtures of the inference tests: a tiny checkpoint, a folder of its images, and its exports (made once)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vlfit.data.sources import open_splits


def save_tiny_checkpoint(dataset_dir: str, output_dir: Path, seed: int = 0) -> Path:
    """A random-init tiny-preset checkpoint folder with its tokenizer (trained on the dataset's captions) and image
    processor, as ``vlfit train`` saves one."""
    from vlfit.arguments import ModelArguments
    from vlfit.models.loading import build_model, resolve_model

    args = ModelArguments(model_preset="tiny")
    train = open_splits(dataset_name=dataset_dir)["train"]
    blueprint = resolve_model(args, captions=train.captions)
    torch.manual_seed(seed)
    model = build_model(blueprint, args)
    model.save_pretrained(output_dir)
    blueprint.inputs.tokenizer.save_pretrained(output_dir)
    blueprint.image_processor.save_pretrained(output_dir)
    return output_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory) -> Path:
    return save_tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def image_folder(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """The validation and test images of the synthetic dataset as JPEG files in two sub-folders, plus one file that
    is not an image."""
    folder = tmp_path_factory.mktemp("images")
    splits = open_splits(dataset_name=synthetic_dataset_dir)
    for split in ("validation", "test"):
        (folder / split).mkdir()
        for record in splits[split]:
            (folder / split / f"{record.id}.jpg").write_bytes(record.image)
    (folder / "test" / "broken.jpg").write_bytes(b"not a jpeg at all")
    return folder


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


@pytest.fixture(scope="session")
def other_checkpoint(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """A second tiny checkpoint: same architecture and tokenizer, other weights."""
    return save_tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory.mktemp("other") / "model", seed=1)


@pytest.fixture(scope="session")
def onnx_export(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory) -> Path:
    """``vlfit export --quantize int8`` of the tiny checkpoint, calibrated on the synthetic dataset."""
    from vlfit.cli import main

    out = tmp_path_factory.mktemp("export") / "onnx"
    assert main(["export", "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(out), "--quantize",
                 "int8", "--calibration_dataset", synthetic_dataset_dir, "--parity_samples", "13",
                 "--calibration_samples", "16"]) == 0  # fmt: skip
    return out
