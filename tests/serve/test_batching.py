"""MicroBatcher: with no waiting, a batch is every query that queued while the previous batch ran."""

from __future__ import annotations

import asyncio
import threading

from vlfit.serve.batching import MicroBatcher


def test_queries_that_queue_during_a_batch_form_the_next_one_without_waiting() -> None:
    running, release = threading.Event(), threading.Event()
    sizes: list[int] = []

    def run_batch(texts, k):
        sizes.append(len(texts))
        running.set()
        assert release.wait(10)  # the first batch holds the worker until the others have queued
        return [[f"{text}@{k}"] * k for text in texts]

    async def run() -> list:
        batcher = MicroBatcher(run_batch, max_batch=4, max_wait_ms=0)
        first = asyncio.ensure_future(batcher.submit("a", 1))
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 10)
        later = [asyncio.ensure_future(batcher.submit(text, 2)) for text in "bcdefg"]
        await asyncio.sleep(0.05)  # all six are queued behind the running batch
        release.set()
        results = await asyncio.gather(first, *later)
        await batcher.close()
        return results

    results = asyncio.run(run())
    assert sizes == [1, 4, 2]  # alone at once; then what queued, max_batch at a time
    assert results[0] == ["a@1"] and results[1:] == [[f"{t}@2"] * 2 for t in "bcdefg"]
