"""Work done for a request only while its client waits for it: a client that disconnects cancels its work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from fastapi import Request


class ClientGone(Exception):
    """The request's client disconnected before its answer was computed."""


async def unless_disconnected(request: Request, pool: Executor | None, work: Callable[[], Any]) -> Any:
    """``work()``'s result (run on ``pool``; without one, ``work`` makes a coroutine), unless the client disconnects
    first: then the work is cancelled (a query still queued is never computed) and ``ClientGone`` is raised."""
    if await request.is_disconnected():
        raise ClientGone
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work() if pool is None else loop.run_in_executor(pool, work))
    gone = loop.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: what the server receives now is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
