"""Admission by expected wait: a search that would wait longer than its budget is refused 503 at once.

A static cap (``--max_concurrency``) bounds how many requests queue, not how long they wait: at 2x capacity every
admitted query waits about ``max_concurrency`` / throughput. Here the server estimates, per kind of query, how long a
new query would wait before its own computation starts, and refuses it when that is over the budget:

    expected wait = queries of its kind admitted and not yet answered x recent seconds per query / workers

How that matches the way queries are really computed (``vlfit.serve.batching``, ``vlfit.serve.app``):

- **text**: one collector takes every query queued (up to ``--max_batch``) and runs them as one batch on a single
  encoder thread (``workers`` 1). Seconds per query is each batch's time divided by its size, so under load (large
  batches) it is the batched, amortized cost, and alone the cost of one query. The queries ahead are those queued
  and those of the batch now computing: a new query waits for the rest of that batch and for the batches before its
  own.
- **image**: one query at a time on the image thread (``workers`` 1), never the text encoder's: a queue of its own.

Seconds per query is an exponentially weighted moving average (``EWMA_WEIGHT`` of the newest batch), so the
estimate follows the machine as it gets busier or quieter within a few batches. Before any query of a kind has
been timed, only the count cap applies to it; with nothing ahead a query is always admitted (an idle server never
refuses), whatever the budget.

The budget is ``--max_queue_wait_ms``; without it, ``WAIT_BUDGET_QUERIES`` (10) times the recent time of a query
computed alone (a batch of one), per kind: "queue no more than ten unloaded queries' worth of work". Until a query
has been computed alone, the per-query time of the batches stands for it (smaller: the budget is stricter).

Where the idea comes from: CoDel (RFC 8289) judges a queue by the time its packets wait, not by its length, against
a small target; Envoy's adaptive concurrency filter (gradient controller) measures the latency of an upstream
under ideal conditions (its minRTT, taken at a very low concurrency) and scales the concurrency limit by how far
the sampled latency is from it. This takes the measure from the first (time waited, not count) and the reference
from the second (the time of a query computed alone), but predicts the wait at arrival from the queue and the
recent service time instead of dropping at the head or adjusting a limit per window: a refused client learns at
once, and an admitted one is not dropped later.

Each worker process of ``--workers N`` estimates its own queues.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("text", "image")
EWMA_WEIGHT = 0.2  # the newest batch's share of the per-query time: about the last 5-10 batches count
WAIT_BUDGET_QUERIES = 10  # the default budget: this many times the time of a query computed alone


@dataclass
class ServiceTime:
    """Recent seconds per query of one kind: an EWMA over batches of ``seconds / size``, and another over the
    batches of one query (the time of a query computed alone). ``None`` until observed."""

    per_query: float | None = None
    alone: float | None = None

    def observe(self, size: int, seconds: float) -> None:
        """One batch of ``size`` queries took ``seconds``."""
        if size < 1 or seconds < 0:
            return
        self.per_query = _ewma(self.per_query, seconds / size)
        if size == 1:
            self.alone = _ewma(self.alone, seconds)


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - EWMA_WEIGHT) * current + EWMA_WEIGHT * sample


@dataclass
class _Queue:
    workers: int
    pending: int = 0  # admitted and not yet answered: queued or computing
    time: ServiceTime = field(default_factory=ServiceTime)


class WaitAdmission:
    """Per kind of query (``text``, ``image``): the queries admitted and not yet answered, their recent service
    time, and the decision to admit one more.

    Args:
        budget: The most expected wait, in seconds, a query is admitted with (``None``: ``WAIT_BUDGET_QUERIES``
            times the kind's recent time of a query computed alone).
        workers: Threads computing each kind's queries (the batcher's encoder thread, the image thread: 1 each).
    """

    def __init__(self, budget: float | None = None, workers: dict[str, int] | None = None) -> None:
        if budget is not None and not budget > 0:
            raise ValueError(f"the wait budget must be positive seconds, got {budget}")
        self.budget = budget
        workers = workers or {}
        self._queues = {kind: _Queue(workers.get(kind, 1)) for kind in KINDS}

    def observe(self, kind: str, size: int, seconds: float) -> None:
        """A batch of ``size`` queries of ``kind`` was computed in ``seconds``."""
        self._queues[kind].time.observe(size, seconds)

    def pending(self, kind: str) -> int:
        """Queries of ``kind`` admitted and not yet answered."""
        return self._queues[kind].pending

    def expected_wait(self, kind: str) -> float | None:
        """Seconds a new query of ``kind`` would wait before its computation starts; ``None`` before any timing."""
        queue = self._queues[kind]
        if queue.time.per_query is None:
            return None
        return queue.pending * queue.time.per_query / queue.workers

    def budget_for(self, kind: str) -> float | None:
        """The wait ``kind`` is admitted with: the fixed budget, or the derived one (``None`` before any timing)."""
        if self.budget is not None:
            return self.budget
        time = self._queues[kind].time
        alone = time.alone if time.alone is not None else time.per_query
        return None if alone is None else WAIT_BUDGET_QUERIES * alone

    def over_budget(self, kind: str) -> tuple[float, float] | None:
        """``(expected wait, budget)`` in seconds when a new query of ``kind`` would wait over its budget, else
        ``None`` (admit it)."""
        wait, budget = self.expected_wait(kind), self.budget_for(kind)
        if wait is None or budget is None or wait <= budget:
            return None
        return wait, budget

    @contextlib.contextmanager
    def admitted(self, kind: str) -> Iterator[None]:
        """Counts a query of ``kind`` as pending while the block runs (until it is answered, fails or is
        cancelled)."""
        queue = self._queues[kind]
        queue.pending += 1
        try:
            yield
        finally:
            queue.pending -= 1
