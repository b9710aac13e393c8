"""A model of two pretrained towers (``--vision_model_name_or_path``, ``--text_model_name_or_path``): the towers'
weights, tokenizer and image processor as saved, new projections of ``--projection_dim``, LiT's locked image tower,
a run that plain transformers loads, and the flags refused in one line before anything is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import CAPTIONS
from tests.test_logging import transformers_messages
from vlfit.arguments.model import ModelArguments
from vlfit.errors import ConfigError
from vlfit.logs import configure_third_parties
from vlfit.models.loading import load_model


def _captions():
    return CAPTIONS * 4


@pytest.fixture(scope="module")
def towers(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny ViT (with its image processor) and a tiny BERT (with its tokenizer), each saved as a pretrained tower
    is: the ``two-tower-tiny`` preset's towers. ``(vision folder, text folder, the preset's model)``."""
    folder = tmp_path_factory.mktemp("towers")
    torch.manual_seed(0)
    preset = load_model(model_preset="two-tower-tiny", captions=_captions)
    preset.model.vision_model.save_pretrained(folder / "vit")
    preset.spec.image_processor.save_pretrained(folder / "vit")
    preset.model.text_model.save_pretrained(folder / "bert")
    preset.tokenizer.save_pretrained(folder / "bert")
    return folder / "vit", folder / "bert", preset.model


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    first, second = a.state_dict(), b.state_dict()
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


def test_a_model_of_two_towers_keeps_their_weights_and_inputs_and_saves_a_plain_transformers_run(towers, tmp_path):
    from transformers import AutoModel

    vision, text, preset = towers
    loaded = load_model(vision_model_name_or_path=str(vision), text_model_name_or_path=str(text), projection_dim=32)
    model = loaded.model
    assert loaded.family.name == "two-tower" and loaded.spec.towers == (str(vision), str(text))
    assert _same(model.vision_model, preset.vision_model) and _same(model.text_model, preset.text_model)
    assert model.visual_projection.weight.shape == (32, 64) and model.text_projection.weight.shape == (32, 64)
    # the towers' own inputs: the vision tower's processor (64 px, mean and std 0.5), the text tower's tokenizer
    assert loaded.inputs.image_size == 64 and loaded.inputs.image_mean == (0.5, 0.5, 0.5)
    assert loaded.tokenizer.get_vocab() == preset_vocab(text)

    loaded.save(str(tmp_path / "run"))
    plain = AutoModel.from_pretrained(tmp_path / "run")
    assert type(plain).__name__ == "VisionTextDualEncoderModel" and _same(plain, model)
    again = load_model(model_name_or_path=str(tmp_path / "run"))
    assert again.family.name == "two-tower" and again.inputs.image_size == 64
    assert again.inputs.image_mean == (0.5, 0.5, 0.5)


def preset_vocab(folder: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).get_vocab()


def test_a_clip_checkpoint_gives_its_vision_tower(tmp_path, towers):
    from vlfit.models.registry import family_for_preset

    torch.manual_seed(0)
    clip = load_model(model_preset="clip-tiny", captions=_captions)
    clip.save(str(tmp_path / "clip"))
    _, text, _ = towers
    with transformers_messages() as messages:
        configure_third_parties("info")  # as the CLI does: transformers' 24-row table of the text tower's keys
        loaded = load_model(vision_model_name_or_path=str(tmp_path / "clip"), text_model_name_or_path=str(text))
    assert not [message for message in messages if "LOAD REPORT" in message or "UNEXPECTED" in message], messages
    assert type(loaded.model.vision_model).__name__ == "CLIPVisionModel"
    assert _same(loaded.model.vision_model, clip.model.vision_model)
    assert loaded.inputs.image_mean == family_for_preset("clip-tiny").preset_image_processor("clip-tiny").image_mean
    assert loaded.model.visual_projection.weight.shape[0] == 512  # the default shared space


def test_a_locked_image_tower_leaves_the_text_tower_and_projections_training(towers):
    vision, text, _ = towers
    arguments = ModelArguments(vision_model_name_or_path=str(vision), text_model_name_or_path=str(text),
                               lock_image_tower=True)  # fmt: skip
    assert arguments.frozen_towers() == ("vision",)
    model = load_model(**arguments.source_keywords(), **arguments.build_keywords()).model
    training = {name.split(".")[0] for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert training == {"text_model", "visual_projection", "text_projection", "logit_scale"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"vision_model_name_or_path": "v"}, "a model of two towers needs both: pass --text_model_name_or_path too"),
        ({"vision_model_name_or_path": "v", "text_model_name_or_path": "t", "model_preset": "tiny"},
         "drop --model_name_or_path / --model_preset"),
        ({"model_preset": "clip-tiny", "projection_dim": 64}, "--projection_dim sizes the projections of a model"),
        ({"vision_model_name_or_path": "v", "text_model_name_or_path": "t", "projection_dim": 0},
         "--projection_dim must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_the_two_tower_flags_are_refused_in_one_line_before_anything_loads(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelArguments(**flags)


def test_a_tower_of_the_wrong_kind_is_refused_naming_its_flag(towers):
    vision, text, _ = towers
    with pytest.raises(ConfigError, match=rf"^--vision_model_name_or_path {text}: a bert model is not a vision tower"):
        load_model(vision_model_name_or_path=str(text), text_model_name_or_path=str(text))
    with pytest.raises(ConfigError, match=rf"^--text_model_name_or_path {vision}: a vit model is not a text tower"):
        load_model(vision_model_name_or_path=str(vision), text_model_name_or_path=str(vision))
