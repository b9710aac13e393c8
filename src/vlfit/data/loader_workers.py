"""Stopping a failed run's loader workers while it can still stop them quickly.

When an error ends a loop over a ``DataLoader`` with workers, the loader's iterator stays alive as a local of the
frames the error passed through, for as long as the error's traceback is kept (a caller holding the exception,
reference cycles until the next garbage collection). Stopped that late, from whatever runs then, each worker took
torch's whole shutdown timeout (5 s) to exit. ``stop_loader_workers`` stops them at once, from the traceback.

An error (a stop signal's) can also land while an iterator is being made, before torch set its ``_shutdown``: its
``__del__`` then fails with an ``AttributeError`` that Python prints as "Exception ignored ..." with a traceback,
after the run's one line. Such an iterator's started workers are stopped here and it is marked shut down.
"""

from __future__ import annotations

from types import TracebackType

from torch.utils.data.dataloader import _BaseDataLoaderIter


def stop_loader_workers(traceback: TracebackType | None) -> int:
    """Shut down the worker processes of every loader iterator held by the frames of ``traceback`` (those the
    error unwound); returns how many iterators had workers to stop. Locals are left as they are (a post-mortem
    debugger still sees them)."""
    stopped = 0
    seen: set[int] = set()
    while traceback is not None:
        for value in list(traceback.tb_frame.f_locals.values()):
            if isinstance(value, _BaseDataLoaderIter) and id(value) not in seen:
                seen.add(id(value))
                if not hasattr(value, "_shutdown"):  # made only in part: its __del__ would fail
                    stopped += _stop_started(value)
                    continue
                shutdown = getattr(value, "_shutdown_workers", None)
                if shutdown is not None and getattr(value, "_workers", None):
                    shutdown()
                    stopped += 1
        traceback = traceback.tb_next
    return stopped


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
