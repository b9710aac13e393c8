"""Admission by expected wait: a search that would wait longer than its budget is refused 503 at once.

A static cap (``--max_concurrency``) bounds how many requests queue, not how long they wait: at 2x capacity every
admitted query waits about ``max_concurrency`` / throughput. Here the server estimates, per kind of query, how long a
new query would wait, and refuses it when that is over the budget:

    expected wait = queries of its kind admitted and not yet answered x recent seconds per query ahead

Seconds per query ahead is measured, not modelled: each answered query's time in the server (from its admission,
as its whole request reaches the app's middleware ``vlfit.serve.middleware.WaitLimit``, to its answer) divided by
the queries it found ahead of it plus one, an exponentially weighted moving average (``EWMA_WEIGHT`` of the
newest). It is the time each queued query really adds, however they are computed:

- **text** queries are batched (``vlfit.serve.batching``: one collector takes every query queued, up to
  ``--max_batch``, and runs them as one batch on a single encoder thread); where a batch costs less than its
  queries alone (a GPU), the time per query ahead falls as batches grow, and more queries are admitted.
- **image** queries run one at a time on a thread of their own: a queue of their own, never behind the texts. A
  multipart upload is one from its head; a JSON search is admitted from its head as a text (what most are: its
  head cannot tell, so the texts' budget may refuse it there) and, when its body holds a base64 image, moved to the
  image queue (``WaitAdmission.settle``), refused there when that queue is over its budget, and timed there.
- **vectorize** requests (Weaviate's ``/vectorize``, ``vlfit.serve.weaviate``, and OpenAI's ``/v1/embeddings``,
  ``vlfit.serve.openai_api``: texts and images together) run one at a time on a thread of their own: a queue of
  their own, so a bulk import is never ahead of a search.
- What the encoder's time alone would not show is in it too: the event loop reading, parsing and answering every
  request in flight (on a 2-core machine under overload, most of a query's time), the interpreter lock the
  encoder thread shares with it, other processes on the same cores. (Estimates from the encoder's batch times,
  and then from the time after the query was parsed, both tried first, admitted queries that went on to wait
  several times the budget.)

What it cannot see is the time a request spends before the app sees it at all: read and parsed behind every other
request the event loop is serving, refused ones included. Adding the event loop's delay (how late it runs a timer,
as Fastify's ``under-pressure`` plugin measures it) was tried and left out: a refused request still costs the loop
its reading, parsing and answer, so under closed-loop clients that send again at once the delay grew with the
refusals, the server admitted only queries with nothing ahead, and its answers fell from about 450 to 40-160 per
second at 32 clients (``benchmarks/serve_load.py``).

The budget is ``--max_queue_wait_ms`` (see ``vlfit.serve.limits``); 0, its default, derives it:
``WAIT_BUDGET_QUERIES`` (10) times the unloaded time of a query, per kind: the shortest of the last
``REFERENCE_ANSWERS`` (100) that found nothing ahead of them ("no more than ten unloaded queries' worth of
waiting"). The shortest, as Envoy takes a minimum round-trip time: under overload even a query with nothing ahead of
it waits for the event loop, and an average of those (tried first) let the budget grow with the overload it is meant
to bound. Before a query of a kind has been answered, only the count cap applies to it; with nothing ahead a query
is always admitted (an idle server never refuses), whatever the budget, and under the derived budget so is one with
fewer than ``WAIT_FLOOR_QUERIES`` (8) ahead; a query whose client went away or that failed is not timed.

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

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from vlfit.serve.limits import SEARCH_PATH, VECTORIZING_PATHS

KINDS = ("text", "image", "vectorize")
TICKET_KEY = "vlfit.ticket"  # a request's scope entry: its Ticket, from the end of its body (connection or WaitLimit)
RETRY_AFTER_S = 1  # what a refused client is told to wait: a batch takes milliseconds, the queue drains in < 1 s
EWMA_WEIGHT = 0.1  # the newest answer's share: about the last 10-20 answers count
REFERENCE_ANSWERS = 100  # the unloaded time is the shortest of this many answers that found nothing ahead
WAIT_BUDGET_QUERIES = 10  # the default budget: this many times the time of a query with nothing ahead
# Under the derived budget a query with fewer of its kind ahead is admitted whatever the estimate: at that depth the
# estimate (recent time per query ahead against the fastest query alone) refused about 1% of 8 closed-loop clients'
# queries on an idle 2-core server, and each refusal stalls a client that sends again for its Retry-After
# (``benchmarks/serve_load.py``: 320-540 answers/s at concurrency 8 where no budget answered 1050-1140).
WAIT_FLOOR_QUERIES = 8


@dataclass
class ServiceTime:
    """Recent seconds per query ahead of one kind (an EWMA), and its unloaded time (the shortest of the last
    ``REFERENCE_ANSWERS`` that found nothing ahead); ``None`` until observed."""

    per_query: float | None = None
    alone: float | None = None
    _alone_times: deque[float] = field(default_factory=lambda: deque(maxlen=REFERENCE_ANSWERS), repr=False)

    def observe(self, ahead: int, seconds: float) -> None:
        """A query that found ``ahead`` queries of its kind before it was answered ``seconds`` after admission."""
        if ahead < 0 or seconds < 0:
            return
        self.per_query = _ewma(self.per_query, seconds / (ahead + 1))
        if ahead == 0:
            self._alone_times.append(seconds)
            self.alone = min(self._alone_times)


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - EWMA_WEIGHT) * current + EWMA_WEIGHT * sample


@dataclass
class Ticket:
    """An admitted query of ``kind``, pending from ``started`` with ``ahead`` queries of its kind before it;
    ``answered`` False leaves it untimed (its client went away, or it failed)."""

    kind: str
    started: float
    ahead: int
    answered: bool = True
    claimed: bool = False  # taken by the app's WaitLimit from the connection that entered it (which leaves it else)


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
        self._queues = {kind: _Queue() for kind in KINDS}

    def pending(self, kind: str) -> int:
        """Queries of ``kind`` admitted and not yet answered."""
        return self._queues[kind].pending

    def service_time(self, kind: str) -> ServiceTime:
        return self._queues[kind].time

    def expected_wait(self, kind: str) -> float | None:
        """Seconds a new query of ``kind`` would wait for those ahead of it; ``None`` before any was answered."""
        queue = self._queues[kind]
        if queue.time.per_query is None:
            return None
        return queue.pending * queue.time.per_query

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
        if self.budget is None and self._queues[kind].pending < WAIT_FLOOR_QUERIES:
            return None  # the derived budget leaves a light load alone
        wait, budget = self.expected_wait(kind), self.budget_for(kind)
        if wait is None or budget is None or wait <= budget:
            return None
        return wait, budget

    def enter(self, kind: str) -> Ticket:
        """Count a query of ``kind`` as pending from now (``leave`` ends it)."""
        queue = self._queues[kind]
        ticket = Ticket(kind, self.clock(), queue.pending)
        queue.pending += 1
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """The query of ``ticket`` is no longer pending; timed when it was ``answered``."""
        queue = self._queues[ticket.kind]
        queue.pending -= 1
        if ticket.answered:
            queue.time.observe(ticket.ahead, self.clock() - ticket.started)

    def settle(self, ticket: Ticket, kind: str) -> tuple[float, float] | None:
        """The query of ``ticket``, admitted from its head as ``ticket.kind``, is of ``kind`` by its body (a JSON
        search's base64 image): it moves to that kind's queue, behind the queries pending there, and is timed
        there. Returns ``(expected wait, budget)`` when that queue keeps it over its budget, as ``over_budget`` says
        of a new query of ``kind`` (refuse it), else ``None``."""
        if kind == ticket.kind:
            return None
        over = self.over_budget(kind)
        self._queues[ticket.kind].pending -= 1
        queue = self._queues[kind]
        ticket.kind, ticket.ahead = kind, queue.pending
        queue.pending += 1
        return over

    @contextlib.contextmanager
    def admitted(self, kind: str) -> Iterator[Ticket]:
        """Counts a query of ``kind`` as pending while the block runs, and times it when the block ends normally
        with its ticket ``answered`` (an exception, such as the request's cancellation, leaves it untimed)."""
        ticket = self.enter(kind)
        try:
            yield ticket
        except BaseException:
            ticket.answered = False
            raise
        finally:
            self.leave(ticket)


def query_kind(content_type: bytes, path: str = SEARCH_PATH) -> str:
    """The kind of a query from its route and ``Content-Type``, as its head is admitted: on ``/api/search`` a
    multipart upload is an image query, any other body a text query (a JSON body may be a base64 image: the route
    ``settle``s its ticket in the image queue once the body is parsed); a request of Weaviate's ``/vectorize``
    or OpenAI's ``/v1/embeddings`` (texts and images together) is a queue of its own."""
    if path in VECTORIZING_PATHS:
        return "vectorize"
    return "image" if content_type.lower().startswith(b"multipart/") else "text"


def refusal_message(kind: str, over: tuple[float, float]) -> str:
    """What a search refused by ``WaitAdmission.over_budget`` (``over``: its expected wait and the budget) is told."""
    article = "an" if kind[:1] in "aeiou" else "a"
    return (f"{article} {kind} query would wait about {_ms(over[0])} here, over the budget of {_ms(over[1])} "
            f"(--max_queue_wait_ms); retry after {RETRY_AFTER_S} s")  # fmt: skip


def _ms(seconds: float) -> str:
    milliseconds = 1000 * seconds
    return f"{milliseconds:.0f} ms" if milliseconds >= 100 else f"{milliseconds:.2g} ms"
