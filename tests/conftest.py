import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def synthetic_dataset_dir(tmp_path_factory) -> str:
    """A small synthetic New-Yorker-like dataset on disk (save_to_disk format), made once per test session."""
    from vlfit.data.synthetic import SyntheticConfig, make_dataset, save_dataset

    path = tmp_path_factory.mktemp("synthetic") / "data"
    config = SyntheticConfig(num_samples=80, seed=3, min_long_side=160, max_long_side=320)
    save_dataset(make_dataset(config), str(path), format="arrow")
    return str(path)
