"""The one WiSE-FT mix (``vlfit.models.interpolation.interpolate``) of ``vlfit wise-ft`` and ``--wise_ft_alpha``."""

from __future__ import annotations

import torch

from vlfit.models.interpolation import interpolate


def test_a_weight_only_the_finetuned_model_has_keeps_its_finetuned_value() -> None:
    # The matching head an --objective with ITM adds has no start to mix with.
    head = torch.randn(2, 4)
    mixed = interpolate({"w": torch.zeros(3)}, {"w": torch.ones(3), "itm_score.fc.weight": head}, 0.25)
    assert mixed["w"].tolist() == [0.25] * 3
    assert torch.equal(mixed["itm_score.fc.weight"], head)
