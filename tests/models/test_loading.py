"""Loading: a preset or a checkpoint resolved to its family, config, tokenizer and image processor without weights,
then built; what a fine-tuned run saves loads back."""

import pytest
import torch

from tests.checkpoints import save_bundle
from vlfit.arguments import ModelArguments
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.loading import build_model, load_model, resolve_model

CAPTIONS = ["two red circles on the left", "one blue square at the top", "three green crosses"] * 10


@pytest.fixture(scope="module")
def tiny_bundle():
    torch.manual_seed(0)
    return load_model(model_preset="tiny", captions=lambda: CAPTIONS)


def test_resolving_a_preset_builds_no_model(monkeypatch: pytest.MonkeyPatch):
    def refuse(self, config):
        raise AssertionError("resolve_model must not build the model")

    monkeypatch.setattr(BridgeTowerFamily, "build", refuse)
    spec = resolve_model(model_preset="tiny", captions=lambda: CAPTIONS, max_seq_length=40)
    assert spec.inputs.image_size == 64 and spec.inputs.max_seq_length == 40
    assert spec.inputs.tokenizer("red circles").input_ids[0] == 0  # RoBERTa's <s>
    assert spec.description == "preset tiny" and spec.family.name == "bridgetower"


def test_bundle_knows_size_mean_std_and_freezes_only_the_text_pooler(tiny_bundle):
    assert tiny_bundle.image_size == 64
    assert tiny_bundle.inputs.image_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    frozen = [n for n, p in tiny_bundle.model.named_parameters() if not p.requires_grad]
    assert frozen and all("text_model.pooler" in n for n in frozen)


def test_a_saved_run_loads_back_with_from_pretrained(tiny_bundle, tmp_path):
    save_bundle(tiny_bundle, str(tmp_path))  # what a training run writes
    loaded = load_model(model_name_or_path=str(tmp_path))
    assert isinstance(loaded.family, BridgeTowerFamily)
    assert loaded.image_size == tiny_bundle.image_size
    assert loaded.inputs.image_std == pytest.approx(tiny_bundle.inputs.image_std)
    assert loaded.tokenizer("red circles").input_ids == tiny_bundle.tokenizer("red circles").input_ids
    for (name, a), (_, b) in zip(
        tiny_bundle.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_freeze_flags():
    args = ModelArguments(model_preset="tiny", freeze_vision_model=True, freeze_text_model=True)
    bundle = load_model(**args.source_keywords(), **args.build_keywords(), captions=lambda: CAPTIONS)
    tower = bundle.model.bridgetower
    assert not any(p.requires_grad for p in tower.vision_model.parameters())
    assert not any(p.requires_grad for p in tower.text_model.parameters())
    assert any(p.requires_grad for p in tower.cross_modal_text_layers.parameters())


@pytest.mark.parametrize(("path", "preset"), [(None, None), ("some/checkpoint", "tiny")], ids=["neither", "both"])
def test_exactly_one_of_checkpoint_or_preset(path, preset):
    with pytest.raises(ValueError, match="exactly one of --model_name_or_path"):
        resolve_model(model_name_or_path=path, model_preset=preset, captions=lambda: CAPTIONS)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown --model_preset 'giant'"):
        resolve_model(model_preset="giant", captions=lambda: CAPTIONS)


def test_models_take_keyword_arguments_not_the_clis_dataclasses():
    """vlfit.models sits under the CLI: the flags arrive as keywords (the CLI and training convert at their edge),
    and the spec keeps the hub settings the weights load with."""
    spec = resolve_model(model_preset="clip-tiny", captions=lambda: CAPTIONS, max_seq_length=16)
    assert spec.description == "preset clip-tiny" and spec.hub["revision"] == "main"
    model = build_model(spec, attn_implementation="eager", frozen_towers=("vision",))
    vision = [p.requires_grad for name, p in model.named_parameters() if name.startswith("vision_model.")]
    assert vision and not any(vision)
    assert model.config._attn_implementation == "eager"
    bundle = load_model(model_preset="clip-tiny", captions=lambda: CAPTIONS, frozen_towers=("text",))
    assert not any(p.requires_grad for name, p in bundle.model.named_parameters() if name.startswith("text_model."))
    with pytest.raises(TypeError, match="positional"):  # the CLI's dataclass is no way in: it converts itself
        resolve_model(ModelArguments(model_preset="tiny"), captions=lambda: CAPTIONS)  # type: ignore[misc]


def test_the_text_positions_note_is_only_for_a_length_asked_for(caplog):
    clip_positions = 77  # clip-tiny's text positions, as CLIP's
    with caplog.at_level("INFO", logger="vlfit.models.loading"):
        spec = resolve_model(model_preset="clip-tiny", captions=lambda: CAPTIONS)
        assert spec.inputs.max_seq_length == clip_positions and "text positions" not in caplog.text  # the default
        resolve_model(model_preset="clip-tiny", captions=lambda: CAPTIONS, max_seq_length=100)
    assert f"--max_seq_length 100 is longer than the model's {clip_positions} text positions" in caplog.text


def test_a_run_folder_loads_at_its_recorded_caption_length_and_refuses_a_record_that_disagrees(tiny_bundle, tmp_path):
    import json

    from vlfit.errors import ModelLoadError
    from vlfit.models.loading import save_inputs

    tiny_bundle.model.save_pretrained(tmp_path)
    save_inputs(tiny_bundle.spec, str(tmp_path))
    record = json.loads((tmp_path / "input_spec.json").read_text())
    assert record["max_seq_length"] == tiny_bundle.inputs.max_seq_length == 128
    (tmp_path / "input_spec.json").write_text(json.dumps({**record, "max_seq_length": 24}))
    assert resolve_model(model_name_or_path=str(tmp_path)).inputs.max_seq_length == 24
    assert resolve_model(model_name_or_path=str(tmp_path), max_seq_length=40).inputs.max_seq_length == 40
    (tmp_path / "input_spec.json").write_text(json.dumps({**record, "image_size": 96}))
    with pytest.raises(ModelLoadError, match=r"input_spec.json: image_size 96 differs from the model's 64"):
        resolve_model(model_name_or_path=str(tmp_path))
    (tmp_path / "input_spec.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"input_spec.json: cannot read the run's input settings"):
        resolve_model(model_name_or_path=str(tmp_path))
