"""``--logit_scale_init_value``: the logit scale a contrastive model starts training from."""

from __future__ import annotations

import pytest
from torch import nn

from vlfit.models.loading import build_model, resolve_model
from vlfit.models.logit_scale import logit_scale_parameter, set_logit_scale


def test_sets_the_parameter_and_the_config() -> None:
    spec = resolve_model(model_preset="tiny", captions=lambda: ["a cat on a mat", "two dogs"] * 20, max_seq_length=16)
    model = build_model(spec)
    before = logit_scale_parameter(model).item()
    set_logit_scale(model, 3.5)
    assert before != pytest.approx(3.5) and logit_scale_parameter(model).item() == pytest.approx(3.5)
    assert model.config.logit_scale_init_value == 3.5
    assert logit_scale_parameter(model).requires_grad  # still trained


def test_a_model_without_a_logit_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="--logit_scale_init_value: Linear has no logit_scale parameter"):
        set_logit_scale(nn.Linear(2, 2), 1.0)
    assert logit_scale_parameter(nn.Linear(2, 2)) is None
