"""What a model name is: ``vlfit.models.reference.parse_model_reference``."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlfit.errors import ConfigError
from vlfit.models.reference import parse_model_reference


@pytest.mark.parametrize("layout", ["dataset_dict.json", "train/state.json", "train.parquet", "val/data.csv"])
def test_a_data_folder_named_as_a_model_is_refused_as_data(tmp_path: Path, layout: str) -> None:
    (tmp_path / layout).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / layout).write_text("{}")
    with pytest.raises(ConfigError, match=r"--model_name_or_path .*: a data folder .*not a model: pass it as"):
        parse_model_reference(tmp_path)


def test_a_model_folder_beside_data_files_is_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.parquet").write_text("")
    assert parse_model_reference(tmp_path).kind == "checkpoint"
