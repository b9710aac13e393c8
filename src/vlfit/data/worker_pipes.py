"""The pipe a loader's workers hand their batches over: large enough for a batch in one write.

A DataLoader's worker sends each batch to the main process through a multiprocessing queue, which is a pipe. Linux
gives a pipe 64 KiB, so a batch whose tensors travel by value (up to 256 KiB each: ``Batch.__getstate__``) crossed it
in several writes, each waiting for the main process to read the one before: receiving a ``tiny`` batch of 16
64-px images took 1.71 ms of the main process's time a step, and 0.85 ms through a 1 MiB pipe (median of 60
batches, one worker kept ahead, three loaders of each alternated, on 2 cores). ``loader_context`` is the
multiprocessing context whose queues' pipes hold ``PIPE_BYTES`` where the system lets a process raise them (Linux);
elsewhere, or past the system's limit, the pipes are left as they are.
"""

from __future__ import annotations

import fcntl
import multiprocessing
from multiprocessing.context import BaseContext
from typing import Any

PIPE_BYTES = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size: what an unprivileged process may ask


def enlarge_pipe(fd: int, size: int = PIPE_BYTES) -> bool:
    """Ask for a pipe buffer of ``size`` bytes on ``fd``; whether the system gave it (False where it cannot)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        return False
    try:
        return fcntl.fcntl(fd, set_size, size) >= size
    except OSError:  # above pipe-max-size, or past the user's pipe pages: the pipe keeps its size
        return False


class LargePipes:
    """A multiprocessing context's queues, with ``enlarge_pipe`` on each one's pipe."""

    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802 - multiprocessing's name
        queue = super().Queue(maxsize)  # type: ignore[misc]
        enlarge_pipe(queue._reader.fileno())
        return queue


_CLASSES: dict[type, type] = {}


def loader_context(method: str | None) -> BaseContext | str | None:
    """The DataLoader's ``multiprocessing_context`` for start ``method`` (None: the default one): that context with
    ``LargePipes``, or ``method`` as it is where pipes cannot be resized."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return method
    base = type(multiprocessing.get_context(method))
    if base not in _CLASSES:
        name = f"LargePipe{base.__name__}"
        _CLASSES[base] = globals()[name] = type(name, (LargePipes, base), {"__module__": __name__})  # picklable
    return _CLASSES[base]()
