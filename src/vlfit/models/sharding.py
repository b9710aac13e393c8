"""Parameters of an FSDP2-sharded model held whole for a block: what code calling a model's towers piece by piece
(outside the root forward, which gathers the shards itself) needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Hold every FSDP2-sharded parameter of ``model`` whole inside the block (a no-op for other models).

    Evaluation and hard negatives call a model's towers piece by piece, outside the root forward that gathers its
    shards; every process must enter the block (it all-gathers).
    """
    from torch.distributed.fsdp import FSDPModule

    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
