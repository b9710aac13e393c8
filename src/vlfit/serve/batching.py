"""Micro-batching: text queries that arrive together are embedded and searched as one batch.

A request puts its query on a queue and awaits its result. One collector task takes every query waiting (up to
``max_batch``): those that queued while the previous batch ran. With ``max_wait_ms`` > 0 it then keeps taking for
at most that long. It runs the batch (embed the texts, search the index at the largest k asked, re-score the
candidates of the queries that ask for re-ranking with the matching head, all the batch's pairs together) on a
single worker thread, so the event loop keeps accepting requests meanwhile. Alone, a query runs at once
(``max_wait_ms`` 0, the default); under load the worker is never idle, each batch is what arrived during the last
one, and throughput grows with concurrency.

No query hurts another: texts are checked before they are submitted (``vlfit.serve.queries``); a batch that fails
anyway is run again one query at a time, so only the query that fails gets its error; and a query whose request was
cancelled (its client went away) while it waited is dropped before it is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

BatchFunction = Callable[[Sequence[Any], int], list[Any]]


@dataclass
class _Pending:
    text: Any  # what run_batch takes of one query (the server: its text and how many candidates it re-ranks)
    k: int
    future: asyncio.Future


class MicroBatcher:
    """Collects concurrent queries into batches for ``run_batch(texts, k) -> one result per text``.

    Args:
        run_batch: Embeds and searches a batch; called on the worker thread.
        max_batch: The most queries in one batch.
        max_wait_ms: How long a batch waits for more queries after taking those already queued.
        executor: The thread batches run on (one thread: the encoder is not shared between threads).
        on_batch: Called with each batch's size (metrics).
    """

    def __init__(
        self,
        run_batch: BatchFunction,
        *,
        max_batch: int = 32,
        max_wait_ms: float = 0.0,
        executor: ThreadPoolExecutor | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_ms >= 0, got {max_batch} and {max_wait_ms}")
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlfit-search")
        self.on_batch = on_batch
        self._queue: asyncio.Queue[_Pending] | None = None
        self._collector: asyncio.Task | None = None

    async def submit(self, text: Any, k: int) -> Any:
        """The result for one query, computed in a batch with the queries that came with it."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._collector = asyncio.get_running_loop().create_task(self._collect())
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(text, k, future))
        return await future

    async def _collect(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():  # what queued while the last batch ran
                batch.append(self._queue.get_nowait())
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            live = [pending for pending in batch if not pending.future.done()]  # a client may have gone
            if not live:
                continue
            if self.on_batch is not None:
                self.on_batch(len(live))
            k = max(pending.k for pending in live)
            try:
                results = await loop.run_in_executor(self.executor, self.run_batch, [p.text for p in live], k)
            except Exception as err:  # noqa: BLE001 - one query alone gets its error; several are run one by one
                if len(live) == 1:
                    _settle(live[0], error=err)
                else:
                    await self._one_by_one(live)
                continue
            for pending, result in zip(live, results, strict=True):
                _settle(pending, result=result[: pending.k])

    async def _one_by_one(self, batch: list[_Pending]) -> None:
        """Each query of a failed batch alone: the one that failed it gets its error, the others their results."""
        loop = asyncio.get_running_loop()
        for pending in batch:
            if pending.future.done():  # cancelled meanwhile
                continue
            try:
                (result,) = await loop.run_in_executor(self.executor, self.run_batch, [pending.text], pending.k)
            except Exception as err:  # noqa: BLE001 - this query's own error
                _settle(pending, error=err)
            else:
                _settle(pending, result=result)

    async def close(self) -> None:
        """Stop collecting; queries waiting are cancelled."""
        if self._collector is not None:
            self._collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._collector
        self.executor.shutdown(wait=False, cancel_futures=True)


def _settle(pending: _Pending, result: Any = None, error: BaseException | None = None) -> None:
    if pending.future.done():  # the request was cancelled while its batch ran
        return
    if error is not None:
        pending.future.set_exception(error)
    else:
        pending.future.set_result(result)
