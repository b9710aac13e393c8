"""Fixtures of the inference tests: a tiny checkpoint, a folder of its images, and its exports (made once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tiny_models import save_tiny_checkpoint, write_image_folder


@pytest.fixture(scope="session")
def tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory) -> Path:
    return save_tiny_checkpoint(synthetic_dataset_dir, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def image_folder(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """The validation and test images of the synthetic dataset as JPEG files in two sub-folders, plus one file that
    is not an image."""
    return write_image_folder(synthetic_dataset_dir, tmp_path_factory.mktemp("images"))


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
