"""Weight-space ensembling (WiSE-FT, Wortsman et al. 2022): ``theta(alpha) = (1 - alpha) theta_A + alpha theta_B``
between a zero-shot model A and its fine-tuned model B, which trades what B gained on the target for what A knew.

Every floating-point tensor is interpolated, the logit scale too: the families store it as its logarithm (CLIP's,
SigLIP's and BridgeTower's ``logit_scale``), so it is interpolated as a log, as the paper does. Tensors that are not
floating point (position ids) must be equal in both.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vlfit.errors import ConfigError


def check_interpolable(zeroshot: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor]) -> None:
    """Raises ``ConfigError`` naming the first parameter the two models do not share with the same shape."""
    missing = sorted(set(zeroshot) ^ set(finetuned))
    if missing:
        raise ConfigError(
            f"the two models have different parameters ({missing[0]!r} is in only one, {len(missing)} in all): "
            "WiSE-FT needs a fine-tuned model and the model it was fine-tuned from (same family and sizes)"
        )
    for name, tensor in zeroshot.items():
        other = finetuned[name]
        if tensor.shape != other.shape:
            raise ConfigError(
                f"parameter {name!r} has shape {tuple(tensor.shape)} in one model and {tuple(other.shape)} in the "
                "other: WiSE-FT needs the same architecture in both"
            )
        if not tensor.is_floating_point() and not torch.equal(tensor, other):
            raise ConfigError(f"{name!r} differs between the two models and cannot be interpolated")


def interpolate(
    zeroshot: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """``(1 - alpha) * zeroshot + alpha * finetuned`` for every floating-point tensor (in float32, then back to
    each tensor's dtype); other tensors are taken as they are. ``alpha`` 0 gives ``zeroshot``, 1 ``finetuned``."""
    check_interpolable(zeroshot, finetuned)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha {alpha} is outside [0, 1]")
    mixed = {}
    for name, a in zeroshot.items():
        b = finetuned[name]
        if not a.is_floating_point() or alpha == 0.0:
            mixed[name] = a.clone()
        elif alpha == 1.0:
            mixed[name] = b.clone()
        else:
            mixed[name] = torch.lerp(a.float(), b.to(a.device).float(), alpha).to(a.dtype)
    return mixed
