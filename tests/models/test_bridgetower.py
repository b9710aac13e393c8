"""BridgeTower's family module: presets with the real checkpoints' shapes, unimodal encoders equal to the model's
forward, and the family registered under its model type and preset names."""

import pytest
import torch
from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning

from vlfit.models.bridgetower import BridgeTowerFamily, encode_image, encode_text
from vlfit.models.presets import get_preset, list_presets
from vlfit.models.registry import family_for_config, family_for_preset, preset_config


def count_parameters_on_meta(name: str) -> int:
    with torch.device("meta"):
        model = BridgeTowerForContrastiveLearning(preset_config(name))
    return sum(p.numel() for p in model.parameters())


def test_large_matches_bridgetower_large_itm_mlm_itc():
    config = preset_config("large")
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers) == (1024, 24)
    assert config.text_config.num_attention_heads == 16
    assert config.text_config.vocab_size == 50265
    vision = config.vision_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.patch_size, vision.image_size) == (1024, 24, 14, 294)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (1024, 6, 16)
    assert config.contrastive_hidden_size == 512
    assert config.logit_scale_init_value == pytest.approx(2.6592)
    # The published model card says 866M parameters.
    assert count_parameters_on_meta("large") == pytest.approx(866e6, rel=0.005)


def test_base_is_vit_b16_at_288_with_roberta_base_text():
    config = preset_config("base")
    assert (config.vision_config.hidden_size, config.vision_config.patch_size) == (768, 16)
    assert config.vision_config.image_size == 288
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers) == (768, 12)
    assert 320e6 < count_parameters_on_meta("base") < 335e6


@pytest.mark.parametrize("name", [name for name in list_presets() if get_preset(name).family == "bridgetower"])
def test_every_preset_bridges_no_more_layers_than_its_encoders_have(name):
    config = preset_config(name)
    text, vision = config.text_config, config.vision_config
    assert config.num_hidden_layers <= min(text.num_hidden_layers, vision.num_hidden_layers)
    assert text.hidden_size % text.num_attention_heads == 0
    assert vision.hidden_size % 64 == 0  # BridgeTower's vision tower uses hidden // 64 heads


def test_presets_grow_in_size():
    counts = [count_parameters_on_meta(name) for name in ("tiny", "small", "base", "large")]
    assert counts == sorted(counts)
    assert counts[0] < 1e6


def test_tiny_forward_gives_contrastive_outputs_of_the_configured_width():
    torch.manual_seed(0)
    config = preset_config("tiny")
    model = BridgeTowerForContrastiveLearning(config)
    size = config.vision_config.image_size
    out = model(
        input_ids=torch.randint(5, 100, (3, 9)),
        attention_mask=torch.ones(3, 9, dtype=torch.long),
        pixel_values=torch.randn(3, 3, size, size),
        return_loss=True,
    )
    assert out.text_embeds.shape == (3, config.contrastive_hidden_size)
    assert out.image_embeds.shape == (3, config.contrastive_hidden_size)
    assert torch.isfinite(out.loss) and out.loss.item() > 0


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"'huge'.*tiny, small, small-p8, base, large"):
        family_for_preset("huge")


def test_the_registry_finds_bridgetower_by_preset_and_by_model_type():
    assert isinstance(family_for_preset("tiny"), BridgeTowerFamily)
    assert isinstance(family_for_config(BridgeTowerConfig()), BridgeTowerFamily)
    with pytest.raises(ValueError, match=r"model type 'bert' is not supported.*bridgetower"):
        family_for_config(type("Config", (), {"model_type": "bert"})())


def test_unimodal_encoders_match_the_contrastive_forward():
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(preset_config("tiny")).eval()
    input_ids = torch.randint(5, 200, (4, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # padding must be masked the same way
    pixels = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels)
    torch.testing.assert_close(encode_text(model, input_ids, attention_mask), out.text_embeds)
    torch.testing.assert_close(encode_image(model, pixels), out.image_embeds)
    family = BridgeTowerFamily()
    torch.testing.assert_close(family.encode_image(model, pixels), out.image_embeds)
