import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from vlfit.models.presets import PRESETS, get_preset, preset_config


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


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_bridges_no_more_layers_than_its_encoders_have(name):
    preset = get_preset(name)
    assert preset.cross_layers <= min(preset.text_layers, preset.vision_layers)
    assert preset.text_hidden % preset.text_heads == 0
    assert preset.vision_hidden % 64 == 0  # BridgeTower's vision tower uses hidden // 64 heads


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
    with pytest.raises(ValueError, match=r"'huge'.*tiny, small, base, large"):
        get_preset("huge")
