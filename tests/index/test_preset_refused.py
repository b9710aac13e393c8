"""An index is only as searchable as its model can be opened again: a preset's random weights are drawn anew at each
load, so building an index from one is refused in one line before anything is embedded."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

import vlfit
from vlfit.errors import ConfigError


def test_an_index_of_a_preset_is_refused_naming_it(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for number in range(2):
        Image.new("RGB", (32, 24), (90 * number, 40, 40)).save(images / f"{number}.jpg")
    with pytest.raises(ConfigError, match="tiny is a preset: random weights"):
        vlfit.Index.build("tiny", str(tmp_path / "index"), images=str(images))
    assert not (tmp_path / "index" / "index_manifest.json").exists()
