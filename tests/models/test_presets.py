"""Presets are JSON files: listed from their folder without torch, each building the model it always built, and
one more added from a file by its path (``--model_preset``) or by ``vlfit.add_preset``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import vlfit
from vlfit.arguments import ModelArguments
from vlfit.models import presets
from vlfit.models.loading import build_model, resolve_model
from vlfit.models.registry import family_for_preset

# Parameter counts of every shipped preset, measured before presets became files: the files build the same models.
PARAMETERS = {
    "tiny": 530_497,
    "small": 7_191_553,
    "small-p8": 7_087_873,
    "base": 327_921_409,
    "large": 866_612_737,
    "clip-tiny": 263_233,
    "clip-small": 4_466_881,
    "clip-base": 151_277_313,
    "metaclip2-tiny": 263_233,  # clip-tiny's shapes in MetaCLIP 2's classes
    "siglip-tiny": 291_586,
    "siglip-small": 4_896_386,
    "siglip2-small-fixres": 5_036_930,
    "siglip-base": 203_155_970,
    "siglip2-tiny": 291_586,
    "siglip2-small": 5_036_930,
    "two-tower-tiny": 274_881,
}
CAPTIONS = ["two red circles on the left", "one blue square at the top", "three green crosses"] * 10


def test_every_preset_builds_the_parameters_it_always_had():
    assert vlfit.list_presets() == list(PARAMETERS)  # by family, smallest first
    assert sorted(path.stem for path in presets.PRESET_FOLDER.glob("*.json")) == sorted(PARAMETERS)
    for name, expected in PARAMETERS.items():
        family = family_for_preset(name)
        with torch.device("meta"):
            model = family.build(family.preset_config(name))
        assert sum(p.numel() for p in model.parameters()) == expected, name


@pytest.mark.slow
def test_listing_the_presets_imports_neither_torch_nor_transformers():
    code = (
        "import sys, vlfit, vlfit.arguments; names = vlfit.list_presets(); "
        "print(len(names), 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [str(len(PARAMETERS)), "False", "False"]


def _write(path, **changes):
    data = json.loads((presets.PRESET_FOLDER / "clip-tiny.json").read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


def test_a_preset_file_builds_by_its_path_and_by_the_name_add_preset_gives_it(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "_added", {})  # what add_preset adds stays in this test
    data = json.loads((presets.PRESET_FOLDER / "clip-tiny.json").read_text())
    data["config"]["projection_dim"] = 32
    path = _write(tmp_path / "clip-narrow.json", config=data["config"])

    model = build_model(resolve_model(model_preset=str(path), captions=lambda: CAPTIONS, max_seq_length=16))
    assert model.text_projection.out_features == 32

    assert vlfit.add_preset(path) == "clip-narrow"
    assert "clip-narrow" in vlfit.list_presets()
    assert family_for_preset("clip-narrow").preset_config("clip-narrow").projection_dim == 32
    assert vlfit.load(str(path)).encode_texts(["a red circle"]).shape == (1, 32)  # vlfit.load takes the file too
    with pytest.raises(vlfit.ConfigError, match="a preset named 'tiny' exists already"):
        vlfit.add_preset(_write(tmp_path / "tiny.json"))


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"famly": "clip"}, vlfit.ConfigError, r"bad\.json: unknown preset key\(s\) famly"),
        ({"family": "blip"}, vlfit.ConfigError, r"bad\.json\): unknown family 'blip'; choose one of: bridgetower"),
        ({"vision_position_init": "learned"}, vlfit.ConfigError, r"unknown vision_position_init 'learned'"),
        (None, vlfit.MissingFileError, r"--model_preset .*missing\.json: no such preset file"),
    ],
)
def test_a_bad_preset_file_is_refused_naming_the_file_and_the_key(tmp_path, changes, error, message):
    path = tmp_path / "missing.json" if changes is None else _write(tmp_path / "bad.json", **changes)
    with pytest.raises(error, match=message):
        ModelArguments(model_preset=str(path))
