import pytest
import torch

from vlfit.models.encoders import encode_image, encode_text
from vlfit.models.loading import load_model_bundle

CAPTIONS = ["two red circles on the left", "one blue square at the top", "three green crosses"] * 10


@pytest.fixture(scope="module")
def tiny_bundle():
    torch.manual_seed(0)
    return load_model_bundle(model_name_or_path=None, model_preset="tiny", captions=lambda: CAPTIONS)


def test_unimodal_encoders_match_the_contrastive_forward(tiny_bundle):
    model = tiny_bundle.model.eval()
    size = tiny_bundle.image_size
    input_ids = torch.randint(5, 200, (4, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # padding must be masked the same way
    pixels = torch.randn(4, 3, size, size)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels)
    torch.testing.assert_close(encode_text(model, input_ids, attention_mask), out.text_embeds)
    torch.testing.assert_close(encode_image(model, pixels), out.image_embeds)


def test_bundle_knows_size_mean_std_and_freezes_only_the_text_pooler(tiny_bundle):
    assert tiny_bundle.image_size == 64
    assert tiny_bundle.image_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    frozen = [n for n, p in tiny_bundle.model.named_parameters() if not p.requires_grad]
    assert frozen and all("text_model.pooler" in n for n in frozen)


def test_saved_bundle_loads_back_with_from_pretrained(tiny_bundle, tmp_path):
    tiny_bundle.save_pretrained(str(tmp_path))
    loaded = load_model_bundle(model_name_or_path=str(tmp_path), model_preset=None)
    assert loaded.image_size == tiny_bundle.image_size
    assert loaded.image_std == pytest.approx(tiny_bundle.image_std)
    assert loaded.tokenizer("red circles").input_ids == tiny_bundle.tokenizer("red circles").input_ids
    for (name, a), (_, b) in zip(
        tiny_bundle.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_freeze_flags(tmp_path):
    bundle = load_model_bundle(
        model_name_or_path=None,
        model_preset="tiny",
        captions=lambda: CAPTIONS,
        freeze_vision_model=True,
        freeze_text_model=True,
    )
    tower = bundle.model.bridgetower
    assert not any(p.requires_grad for p in tower.vision_model.parameters())
    assert not any(p.requires_grad for p in tower.text_model.parameters())
    assert any(p.requires_grad for p in tower.cross_modal_text_layers.parameters())


@pytest.mark.parametrize(("path", "preset"), [(None, None), ("some/checkpoint", "tiny")], ids=["neither", "both"])
def test_exactly_one_of_checkpoint_or_preset(path, preset):
    with pytest.raises(ValueError, match="exactly one of --model_name_or_path"):
        load_model_bundle(model_name_or_path=path, model_preset=preset, captions=lambda: CAPTIONS)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown --model_preset 'giant'"):
        load_model_bundle(model_name_or_path=None, model_preset="giant", captions=lambda: CAPTIONS)
