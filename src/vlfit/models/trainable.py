"""Parameters made trainable for a block, each put back as it was after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn


@contextlib.contextmanager
def temporarily_trainable(parameters: Iterable[nn.Parameter]) -> Iterator[None]:
    """``requires_grad`` on for ``parameters`` inside the block, and back to each one's own value after it
    (``--unfreeze_after_steps`` builds the optimizer over frozen towers this way; SetFit trains the image path)."""
    parameters = list(parameters)
    flags = [parameter.requires_grad for parameter in parameters]
    for parameter in parameters:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter, flag in zip(parameters, flags, strict=True):
            parameter.requires_grad_(flag)
