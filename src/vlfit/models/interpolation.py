"""Weight-space ensembling (WiSE-FT, Wortsman et al. 2022): ``theta(alpha) = (1 - alpha) theta_A + alpha theta_B``
between a zero-shot model A and its fine-tuned model B, which trades what B gained on the target for what A knew.

Every floating-point tensor is interpolated, the logit scale too: the families store it as its logarithm (CLIP's,
SigLIP's and BridgeTower's ``logit_scale``), so it is interpolated as a log, as the paper does. Tensors that are not
floating point (position ids) must be equal in both. A weight only the fine-tuned model has (the matching head an
``--objective`` with ITM adds to a contrastive checkpoint) keeps its fine-tuned value: it has no start to mix with,
and mixing it with its random initialisation would undo part of its training.

``interpolate`` is the one mix: ``vlfit wise-ft`` draws its curve with it, ``vlfit merge --method wise`` makes one mix
with it and ``vlfit train --wise_ft_alpha`` ends a run with it, so they accept the same pairs of models and give the
same weights. The soups and Model Stock of several runs are ``vlfit.models.soups``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from vlfit.errors import ConfigError

logger = logging.getLogger(__name__)


def check_interpolable(zeroshot: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor]) -> None:
    """Raises ``ConfigError`` naming the first parameter of ``zeroshot`` that ``finetuned`` does not have with the
    same shape (the fine-tuned model may have more: heads its fine-tuning added)."""
    missing = sorted(set(zeroshot) - set(finetuned))
    if missing:
        raise ConfigError(
            f"the two models have different parameters ({missing[0]!r} is in only the zero-shot one, {len(missing)} "
            "in all): WiSE-FT needs a fine-tuned model and the model it was fine-tuned from (same family and sizes)"
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
    each tensor's dtype); other tensors are taken as they are, and tensors only ``finetuned`` has keep their
    fine-tuned values. ``alpha`` 0 gives ``zeroshot`` (with those added tensors), 1 ``finetuned``."""
    check_interpolable(zeroshot, finetuned)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha {alpha} is outside [0, 1]")
    added = [name for name in finetuned if name not in zeroshot]
    kept = ", ".join(sorted({name.split(".")[0] for name in added}))
    logger.info("WiSE-FT: (1 - %g) x the starting weights + %g x the fine-tuned ones%s", alpha, alpha,
                f"; {kept}, new in the fine-tuned model, keeps its fine-tuned weights" if added else "")  # fmt: skip
    mixed = {name: finetuned[name].clone() for name in added}
    for name, a in zeroshot.items():
        b = finetuned[name]
        if not a.is_floating_point() or alpha == 0.0:
            mixed[name] = a.clone()
        elif alpha == 1.0:
            mixed[name] = b.clone()
        else:
            mixed[name] = torch.lerp(a.float(), b.to(a.device).float(), alpha).to(a.dtype)
    return mixed
