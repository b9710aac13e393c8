"""Stopping a failed run's loader workers while it can still stop them quickly.

When an error ends a loop over a ``DataLoader`` with workers, the loader's iterator stays alive as a local of the
frames the error passed through, for as long as the error's traceback is kept (a caller holding the exception,
reference cycles until the next garbage collection). Stopped that late, from whatever runs then, each worker took
torch's whole shutdown timeout (5 s) to exit. ``stop_loader_workers`` stops them at once, from the traceback.
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
                shutdown = getattr(value, "_shutdown_workers", None)
                if shutdown is not None and getattr(value, "_workers", None):
                    shutdown()
                    stopped += 1
        traceback = traceback.tb_next
    return stopped
