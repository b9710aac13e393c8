"""Where a loader worker's batch tensors are allocated: in shared memory only where they cross to the main process
through it.

A ``Batch`` pickled to the main process carries a tensor of up to ``BY_VALUE_BYTES`` by value, inside the pickle
(``vlfit.data.batch``); a larger one crosses as a shared-memory file descriptor, and is written straight into shared
memory so that it crosses uncopied (as torch's ``default_collate`` does in a worker). A small tensor in shared
memory cost a shared-memory file (opened, sized, mapped, unlinked) and its page faults for nothing.
"""

from __future__ import annotations

import math

import torch

# Tensors up to this size travel in a pickled batch by value (see Batch.__getstate__).
BY_VALUE_BYTES = 256 * 1024


def new_uint8(shape: tuple[int, ...], *, shared: bool) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``shape``, in shared memory where ``shared`` (a loader worker's batch) and
    it is larger than ``BY_VALUE_BYTES``, so that it crosses to the main process uncopied."""
    size = math.prod(shape)
    if shared and size > BY_VALUE_BYTES:
        storage = torch.UntypedStorage._new_shared(size)
        return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    return torch.empty(shape, dtype=torch.uint8)
