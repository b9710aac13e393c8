"""Fixtures of the few-shot tests: a labelled synthetic dataset and tiny checkpoints (made once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.inference.tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="session")
def labelled_dataset_dir(tmp_path_factory) -> str:
    """A labelled synthetic set (``kind``: 4 classes) with 64 training rows and 16 test rows."""
    from vlfit.data.synthetic import SyntheticConfig, make_dataset, save_dataset

    path = tmp_path_factory.mktemp("labelled") / "data"
    config = SyntheticConfig(
        num_samples=90, seed=5, min_long_side=96, max_long_side=160, validation_fraction=0.1, test_fraction=0.2,
        labels="kind",
    )  # fmt: skip
    save_dataset(make_dataset(config), str(path), format="arrow")
    return str(path)


@pytest.fixture(scope="session")
def labelled_checkpoint(labelled_dataset_dir, tmp_path_factory) -> Path:
    return save_tiny_checkpoint(labelled_dataset_dir, tmp_path_factory.mktemp("fewshot-tiny") / "model")
