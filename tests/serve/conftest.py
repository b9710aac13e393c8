"""Fixtures of the serving tests: an index of the synthetic training split built with a model that learned it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.built_once import built_once


@pytest.fixture(scope="session")
def served_index(trained_clip, synthetic_dataset_dir, tmp_path_factory) -> Path:
    """The training split (64 captioned images) indexed with ``trained_clip``, with an HNSW structure (what a
    larger index gets than ``auto`` chooses at this size); built once a run (``tests.built_once``)."""
    import vlfit

    def build(folder: Path) -> None:
        vlfit.Index.build(str(trained_clip), str(folder / "index"), dataset_name=synthetic_dataset_dir,
                          split="train", index_type="hnsw")  # fmt: skip

    return built_once(tmp_path_factory, "served-index", build) / "index"


@pytest.fixture(scope="session")
def train_records(synthetic_dataset_dir) -> list:
    from vlfit.data.sources import open_splits

    train = open_splits(dataset_name=synthetic_dataset_dir)["train"]
    return [train[i] for i in range(len(train))]
