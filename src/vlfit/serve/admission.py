"""Admission by expected wait: a search that would wait longer than its budget is refused 503 at once.

A static cap (``--max_concurrency``) bounds how many requests queue, not how long they wait: at 2x capacity every
admitted query waits about ``max_concurrency`` / throughput. Here the server estimates, per kind of query, how long a
new query would wait, and refuses it when that is over the budget:

    expected wait = queries of its kind admitted and not yet answered x recent seconds per query ahead
                    + the event loop's recent delay

Seconds per query ahead is measured, not modelled: each answered query's time in the server (from its admission,
as its request head reaches the app's middleware ``vlfit.serve.middleware.WaitLimit``, to its answer) divided by
the queries it found ahead of it plus one, an exponentially weighted moving average (``EWMA_WEIGHT`` of the
newest). It is the time each queued query really adds, however they are computed:

- **text** queries are batched (``vlfit.serve.batching``: one collector takes every query queued, up to
  ``--max_batch``, and runs them as one batch on a single encoder thread); where a batch costs less than its
  queries alone (a GPU), the time per query ahead falls as batches grow, and more queries are admitted.
- **image** queries run one at a time on a thread of their own: a queue of their own, never behind the texts.
- What the encoder's time alone would not show is in it too: the event loop reading, parsing and answering every
  request in flight (on a 2-core machine under overload, most of a query's time), the interpreter lock the
  encoder thread shares with it, other processes on the same cores. (Estimates from the encoder's batch times,
  and then from the time after the query was parsed, both tried first, admitted queries that went on to wait
  several times the budget.)

The event loop's delay (how late it runs a 10 ms timer, an EWMA) stands for the time a request spends before
the app sees it at all: read and parsed behind every other request the loop is serving, which no count of queries
shows. (Node's ``under-pressure`` plugin for Fastify answers 503 on the event loop's delay alone.)

The budget is ``--max_queue_wait_ms``; without it, ``WAIT_BUDGET_QUERIES`` (10) times the recent time of a query
that found nothing ahead of it, per kind: "no more than ten unloaded queries' worth of waiting". Before a query of
a kind has been answered, only the count cap applies to it; with nothing ahead a query is always admitted (an idle
server never refuses), whatever the budget; a query whose client went away or that failed is not timed.

Where the idea comes from: CoDel (RFC 8289) judges a queue by the time its packets spend in it, not by its length,
against a small target; Envoy's adaptive concurrency filter (gradient controller) measures an upstream's latency
under ideal conditions (its minRTT, taken at a very low concurrency) and scales the concurrency limit by how far
the sampled latency is from it. This takes the measure from the first (time spent, not count) and the reference
from the second (the time of a query with nothing ahead), but predicts a query's wait as it arrives, from the queue
and the recent time per query, instead of dropping at the head or adjusting a limit per window: a refused client
learns at once, and an admitted one is never dropped later.

Each worker process of ``--workers N`` measures its own queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

KINDS = ("text", "image")
EWMA_WEIGHT = 0.1  # the newest answer's share: about the last 10-20 answers count
WAIT_BUDGET_QUERIES = 10  # the default budget: this many times the time of a query with nothing ahead
LAG_INTERVAL_S = 0.01  # how often the event loop's delay is sampled
LAG_WEIGHT = 0.2  # the newest sample's share of the loop's delay: about the last 50-100 ms count


@dataclass
class ServiceTime:
    """Recent seconds per query ahead of one kind, and the recent time of a query that found nothing ahead (an
    EWMA each; ``None`` until observed)."""

    per_query: float | None = None
    alone: float | None = None

    def observe(self, ahead: int, seconds: float) -> None:
        """A query that found ``ahead`` queries of its kind before it was answered ``seconds`` after admission."""
        if ahead < 0 or seconds < 0:
            return
        self.per_query = _ewma(self.per_query, seconds / (ahead + 1))
        if ahead == 0:
            self.alone = _ewma(self.alone, seconds)


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - EWMA_WEIGHT) * current + EWMA_WEIGHT * sample


@dataclass
class Ticket:
    """An admitted query: timed from ``started`` (``restart``: from now); ``answered`` False leaves it untimed
    (its client went away, or it failed)."""

    started: float
    clock: Callable[[], float]
    answered: bool = True

    def restart(self) -> None:
        self.started = self.clock()


@dataclass
class _Queue:
    pending: int = 0  # admitted and not yet answered: queued or computing
    time: ServiceTime = field(default_factory=ServiceTime)


class WaitAdmission:
    """Per kind of query (``text``, ``image``): the queries admitted and not yet answered, their recent time per
    query ahead, and the decision to admit one more.

    Args:
        budget: The most expected wait, in seconds, a query is admitted with (``None``: ``WAIT_BUDGET_QUERIES``
            times the kind's recent time of a query with nothing ahead).
        clock: Seconds, monotonic (``time.perf_counter``; a test gives its own).
    """

    def __init__(self, budget: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if budget is not None and not budget > 0:
            raise ValueError(f"the wait budget must be positive seconds, got {budget}")
        self.budget = budget
        self.clock = clock
        self.loop_lag = 0.0  # recent seconds a callback waits for the event loop (watch_loop)
        self._queues = {kind: _Queue() for kind in KINDS}

    def observe_loop_lag(self, seconds: float) -> None:
        """The event loop ran a timer ``seconds`` late."""
        self.loop_lag = (1 - LAG_WEIGHT) * self.loop_lag + LAG_WEIGHT * max(0.0, seconds)

    async def watch_loop(self, interval: float = LAG_INTERVAL_S) -> None:
        """Samples how late the event loop runs a timer, every ``interval`` seconds, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.observe_loop_lag(loop.time() - due)

    def pending(self, kind: str) -> int:
        """Queries of ``kind`` admitted and not yet answered."""
        return self._queues[kind].pending

    def service_time(self, kind: str) -> ServiceTime:
        return self._queues[kind].time

    def expected_wait(self, kind: str) -> float | None:
        """Seconds a new query of ``kind`` would wait for those ahead of it, and for the event loop; ``None``
        before any was answered, 0 with nothing ahead."""
        queue = self._queues[kind]
        if queue.time.per_query is None:
            return None
        if queue.pending == 0:
            return 0.0
        return queue.pending * queue.time.per_query + self.loop_lag

    def budget_for(self, kind: str) -> float | None:
        """The wait ``kind`` is admitted with: the fixed budget, or the derived one (``None`` before any answer)."""
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
    def admitted(self, kind: str) -> Iterator[Ticket]:
        """Counts a query of ``kind`` as pending while the block runs, and times it when the block ends normally
        with its ticket ``answered`` (an exception, such as the request's cancellation, leaves it untimed)."""
        queue = self._queues[kind]
        ahead, ticket = queue.pending, Ticket(self.clock(), self.clock)
        queue.pending += 1
        try:
            yield ticket
        finally:
            queue.pending -= 1
        if ticket.answered:
            queue.time.observe(ahead, self.clock() - ticket.started)
