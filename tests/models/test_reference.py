"""What a model name is: ``vlfit.models.reference.parse_model_reference``."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlfit.errors import ConfigError
from vlfit.models.reference import folder_kind, parse_model_reference


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


def _index_folder(folder: Path) -> None:
    (folder / "index_manifest.json").write_text("{}")
    (folder / "shard-00000.json").write_text("[]")


def _image_folder(folder: Path) -> None:
    (folder / "trips").mkdir()
    (folder / "trips" / "p0.jpg").write_bytes(b"\xff\xd8")


def _run_folder(folder: Path) -> None:
    for step in (5, 10):
        (folder / f"checkpoint-{step}").mkdir()
        (folder / f"checkpoint-{step}" / "config.json").write_text("{}")


@pytest.mark.parametrize(
    ("make", "what", "use"),
    [
        (_index_folder, "an index (vlfit retrieve index wrote it)", "search it with vlfit retrieve query --index {}"),
        (_image_folder, "a folder of images (it holds trips/p0.jpg)", "index it with vlfit retrieve index --images {}"),
        (_run_folder, "a training run's folder without its final model (it holds checkpoint-10/)",
         "give its checkpoint: {}/checkpoint-10"),
        (lambda folder: None, "an empty folder", None),
    ],
)  # fmt: skip
def test_a_folder_that_is_no_model_is_refused_naming_what_it_is_and_the_command_that_takes_it(
    tmp_path: Path, make, what: str, use: str | None
) -> None:
    make(tmp_path)
    with pytest.raises(ConfigError) as refused:
        parse_model_reference(tmp_path, flag="--model_name_or_path")
    expected = f"--model_name_or_path {tmp_path}: {what}, not a model" + (f": {use.format(tmp_path)}" if use else "")
    assert str(refused.value).startswith(expected + "; name a model with --model_name_or_path: a folder"), refused.value
    assert folder_kind(str(tmp_path)).what == what


def test_vlfit_load_of_an_index_says_it_is_an_index(tmp_path: Path) -> None:
    import vlfit

    _index_folder(tmp_path)
    with pytest.raises(ConfigError, match=r": an index \(vlfit retrieve index wrote it\), not a model: search it with"):
        vlfit.load(str(tmp_path))
