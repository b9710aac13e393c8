"""``--unfreeze_after_steps N``: towers ``--freeze`` froze start training at optimizer step N.

Their parameters go into the optimizer when it is built (each in its weight-decay group, as if trainable), but keep
``requires_grad=False`` until step N: no gradient is computed for them, and AdamW leaves a parameter without a
gradient untouched (no update, no decay, no state). At step N they get gradients and AdamW starts their moments
from zero. A resumed run past step N unfreezes them before its first step.

One process only: DDP decides at wrapping time which parameters it reduces, so parameters that start frozen
would never be averaged across processes once unfrozen.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class UnfreezeCallback(TrainerCallback):
    """Turns gradients on for ``parameters`` once ``state.global_step`` reaches ``step``."""

    def __init__(self, parameters: Sequence[nn.Parameter], step: int, description: str) -> None:
        self.parameters = list(parameters)
        self.step = step
        self.description = description
        self.done = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.done and state.global_step >= self.step:
            for parameter in self.parameters:
                parameter.requires_grad_(True)
            self.done = True
            count = sum(p.numel() for p in self.parameters)
            logger.info("step %d: training the %s tower(s) from now on (%d parameters)", state.global_step,
                        self.description, count)  # fmt: skip
