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


def test_a_failing_batch_is_run_again_one_by_one_so_only_the_failing_query_fails() -> None:
    calls: list[list[str]] = []

    def run_batch(texts, k):
        calls.append(list(texts))
        if "bad" in texts:
            raise ValueError("cannot embed 'bad'")
        return [[text] * k for text in texts]

    async def run() -> list:
        batcher = MicroBatcher(run_batch, max_batch=8, max_wait_ms=50)
        results = await asyncio.gather(*(batcher.submit(text, 1) for text in ("a", "bad", "c")),
                                       return_exceptions=True)  # fmt: skip
        await batcher.close()
        return results

    results = asyncio.run(run())
    assert results[0] == ["a"] and results[2] == ["c"]
    assert isinstance(results[1], ValueError) and "cannot embed 'bad'" in str(results[1])
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]  # the batch, then each query alone


def test_a_query_cancelled_while_queued_is_never_computed() -> None:
    running, release = threading.Event(), threading.Event()
    computed: list[str] = []

    def run_batch(texts, k):
        computed.extend(texts)
        running.set()
        assert release.wait(10)
        return [[text] for text in texts]

    async def run() -> list:
        batcher = MicroBatcher(run_batch, max_batch=4, max_wait_ms=0)
        first = asyncio.ensure_future(batcher.submit("first", 1))
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 10)
        left = asyncio.ensure_future(batcher.submit("left", 1))
        kept = asyncio.ensure_future(batcher.submit("kept", 1))
        await asyncio.sleep(0.05)
        left.cancel()  # its client went away while it waited
        release.set()
        results = await asyncio.gather(first, kept)
        await batcher.close()
        return results

    assert asyncio.run(run()) == [["first"], ["kept"]]
    assert computed == ["first", "kept"]
