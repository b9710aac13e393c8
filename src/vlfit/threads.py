"""Torch intra-op thread control shared by the CPU stages that emulate or run as loader workers, and by a model
runtime's PyTorch parts."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, which containers narrow, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run with ``count`` torch intra-op threads (as each loader worker does, or a runtime asked for), then restore
    the previous count; ``None``, or the count already set: leave it as it is."""
    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def on_own_threads(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` of an object with a ``num_threads`` attribute (a runtime's PyTorch part: its encoder, pair scorer
    or answerer), run inside ``torch_threads(self.num_threads)``: the part runs on its runtime's threads and leaves
    the process's count as it found it."""

    @functools.wraps(method)
    def on_threads(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch_threads(args[0].num_threads):  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return on_threads
