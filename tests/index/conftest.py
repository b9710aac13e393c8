"""Fixtures of the index tests: a folder of images to index (the checkpoints and their export are tests/conftest.py's,
shared with the export tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.inference.tiny_models import write_image_folder


@pytest.fixture(scope="session")
def image_folder(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """The validation and test images of the synthetic dataset as JPEG files in two sub-folders, plus one file that
    is not an image."""
    return write_image_folder(synthetic_dataset_dir, tmp_path_factory.mktemp("images"))
