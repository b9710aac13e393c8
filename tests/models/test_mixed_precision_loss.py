"""Under bf16 autocast (``vlfit train --bf16``), every family's contrastive loss takes its logits in float32 from the
same embeddings, so a bf16 run's loss stays within rounding of the float32 one."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_dual_encoders import _inputs
from tests.training.test_gradient_cache import FAMILIES, _model


@pytest.mark.parametrize("preset", FAMILIES)
def test_under_bf16_autocast_the_loss_takes_float32_logits(preset):
    family, model, inputs = FAMILIES[preset], _model(preset), _inputs()
    with torch.no_grad():
        reference = family.contrastive_loss(model, inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = family.contrastive_loss(model, inputs)
            from_embeddings = family.loss_from_embeddings(family.loss_embeddings(model, inputs))
    assert loss.dtype == torch.float32
    # The float32-logit path, not the model's own loss over bf16 logits (1.865811 where fp32 gives 1.864771 on tiny).
    assert loss.item() == from_embeddings.item()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-3)
