"""``--attn_implementation sdpa`` for BridgeTower: the fused path computes what eager attention computes."""

from __future__ import annotations

import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from vlfit.models.bridgetower import BridgeTowerFamily, set_attention_implementation
from vlfit.models.loading import build_model, load_model, resolve_model
from vlfit.models.registry import preset_config


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 7:] = 0  # padded captions: the masks must reach the fused kernel too
    mask[1, 10:] = 0
    return {
        "input_ids": torch.randint(5, 1000, (3, 12), generator=generator),
        "attention_mask": mask,
        "pixel_values": torch.randn(3, 3, 64, 64, generator=generator),
    }


def _outputs_and_grads(model: BridgeTowerForContrastiveLearning, implementation: str):
    set_attention_implementation(model, implementation)
    model.zero_grad()
    outputs = model(**_batch(), return_loss=True)
    outputs.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return outputs, grads


def test_sdpa_equals_eager_in_embeddings_loss_and_gradients():
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(preset_config("tiny")).eval()  # eval: no dropout to tell apart
    eager, eager_grads = _outputs_and_grads(model, "eager")
    fused, fused_grads = _outputs_and_grads(model, "sdpa")
    for name in ("text_embeds", "image_embeds", "cross_embeds"):
        torch.testing.assert_close(fused[name], eager[name], rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(fused.loss, eager.loss, rtol=1e-5, atol=1e-6)
    assert fused_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_flag_reaches_every_attention_module():
    for implementation in ("eager", "sdpa"):
        model = load_model(
            model_preset="tiny", attn_implementation=implementation, captions=lambda: ["a red circle"] * 8
        ).model
        modules = [m for m in model.modules() if hasattr(m, "query") and hasattr(m, "config")]
        assert modules and {m.config._attn_implementation for m in modules} == {implementation}


def test_models_built_one_after_another_from_one_spec():
    # The bench's worker probe and then training build two models from one spec.
    spec = resolve_model(model_preset="tiny", captions=lambda: ["a red circle"] * 8)
    unset = spec.config._attn_implementation
    first = build_model(spec, attn_implementation="sdpa")
    second = build_model(spec, attn_implementation="sdpa")  # transformers refuses a BridgeTower config that says sdpa
    assert first.config is not second.config and spec.config._attn_implementation == unset != "sdpa"
    assert first.config._attn_implementation == second.config._attn_implementation == "sdpa"


def test_unknown_implementation_is_refused_with_the_choices():
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(preset_config("tiny"))
    with pytest.raises(ValueError, match="eager, sdpa"):
        BridgeTowerFamily().set_attention_implementation(model, "flash_attention_2")
