"""Stopping a failed run's loader workers while it can still stop them quickly.

When an error ends a loop over a ``DataLoader`` with workers, the loader's iterator stays alive as a local of the
frames the error passed through, for as long as the error's traceback is kept (a caller holding the exception,
reference cycles until the next garbage collection). Stopped that late, from whatever runs then, each worker took
torch's whole shutdown timeout (5 s) to exit. ``stop_loader_workers`` stops them at once, from the traceback.

A worker's death can also be raised by torch's SIGCHLD handler in whatever code runs when the signal lands (the
model's forward): the traceback then misses the loader's frames, and the broken iterator, still alive in a suspended
generator, keeps its workers' pids registered; a later SIGCHLD (any child process exiting, the iterator's own
shutdown) raised the same error again from unrelated code. Such iterators, those with a dead worker that were never
shut down, are found among the live objects and stopped too.

An error (a stop signal's) can also land while an iterator is being made, before torch set its ``_shutdown``: its
``__del__`` then fails with an ``AttributeError`` that Python prints as "Exception ignored ..." with a traceback,
after the run's one line. Such an iterator's started workers are stopped here and it is marked shut down.
"""

from __future__ import annotations

import gc
from types import TracebackType

from torch.utils.data.dataloader import _BaseDataLoaderIter


def stop_loader_workers(traceback: TracebackType | None) -> int:
    """Shut down the worker processes of every loader iterator held by the frames of ``traceback`` (those the
    error unwound) and of every live iterator with a dead worker; returns how many iterators had workers to stop.
    Locals are left as they are (a post-mortem debugger still sees them)."""
    stopped = 0
    seen: set[int] = set()
    while traceback is not None:
        for value in list(traceback.tb_frame.f_locals.values()):
            if isinstance(value, _BaseDataLoaderIter) and id(value) not in seen:
                seen.add(id(value))
                stopped += _stop(value)
        traceback = traceback.tb_next
    for iterator in broken_loader_iterators():
        if id(iterator) not in seen:
            stopped += _stop(iterator)
    return stopped


def broken_loader_iterators() -> list[_BaseDataLoaderIter]:
    """Live loader iterators, never shut down, one of whose workers has died: unusable, and each one a
    RuntimeError waiting for the next SIGCHLD."""
    return [
        value
        for value in gc.get_objects()
        if issubclass(type(value), _BaseDataLoaderIter)  # isinstance would ask lazy modules for __class__
        and not getattr(value, "_shutdown", True)
        and any(not worker.is_alive() for worker in getattr(value, "_workers", ()))
    ]


def _stop(iterator: _BaseDataLoaderIter) -> int:
    if not hasattr(iterator, "_shutdown"):  # made only in part: its __del__ would fail
        return _stop_started(iterator)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None and getattr(iterator, "_workers", None):
        shutdown()
        return 1
    return 0


def _stop_started(iterator: _BaseDataLoaderIter) -> int:
    """Terminate the workers an iterator interrupted in ``__init__`` had started, and mark it shut down so that its
    ``__del__`` (torch's ``_shutdown_workers``) does nothing; returns 1 when it had workers."""
    workers = list(getattr(iterator, "_workers", None) or [])
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=1.0)
    iterator._shutdown = True  # type: ignore[attr-defined]
    return 1 if workers else 0
