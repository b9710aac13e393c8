"""The app's ASGI middlewares, outermost first: ``RequestMetrics`` (counts every answer), ``UploadLimit`` (413 beyond
the body limit, 408 for a body that does not arrive in time, 429 beyond a client's bodies arriving at once),
``InFlightLimit`` (503 beyond ``max_concurrency`` requests in flight, 429 beyond a client's share of them),
``WaitLimit`` (503 for a search whose expected wait is over its budget) and ``HeadAsGet`` (``HEAD`` wherever ``GET``
is answered).

A request takes its slot when it is ready to run: ``UploadLimit`` reads its body before ``InFlightLimit`` counts
it, so bodies that trickle in are bounded by their own count per client and by ``--body_timeout``, never by the
searches' slots (32 bodies sent a byte a second took every slot for a minute when the slot was taken at the head).
Both count in the app's ``ClientShares`` (``vlfit.serve.clients``), which the connection reads to refuse at the
head what is over a share already.

What the connection carries before a request exists (idle connections, the request head's size and time, the
number of connections) is bounded one level below, in ``vlfit.serve.connections``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi.responses import JSONResponse

from vlfit.serve.admission import RETRY_AFTER_S, TICKET_KEY, Ticket, WaitAdmission, query_kind, refusal_message
from vlfit.serve.clients import READY_KEY, ClientShares
from vlfit.serve.metrics import ServerMetrics
from vlfit.serve.responses import error_response

logger = logging.getLogger(__name__)


def in_flight_refusal(max_requests: int) -> str:
    """What a request beyond ``max_requests`` in flight (``--max_concurrency``) is told."""
    return _retry(f"the server is answering its limit of {max_requests} requests (--max_concurrency)")


def share_refusal(clients: ClientShares, client: str, *, uploading: bool = False) -> tuple[str, str] | None:
    """``(limit, message)`` of a request of ``client`` over its share (``ClientShares.over_share``); None: within."""
    over = clients.over_share(client, uploading=uploading)
    return None if over is None else (over[0], _retry(over[1]))


def _retry(reason: str) -> str:
    return f"{reason}; retry after {RETRY_AFTER_S} s"


def _refuse(status: int, message: str, limit: str, metrics: ServerMetrics) -> JSONResponse:
    metrics.observe_refused(limit)
    return error_response(status, message, {"Retry-After": str(RETRY_AFTER_S)})


async def _count(clients: ClientShares, metrics: ServerMetrics, scope: dict, receive: Any, send: Any, *,
                 max_in_flight: int | None = None) -> str | None:  # fmt: skip
    """Count the request of ``scope`` for its client: its body arriving, or (``max_in_flight`` given) the request
    in flight. Its client; None where it was refused instead (503 beyond ``max_in_flight`` in all, 429 beyond its
    client's share), the refusal sent."""
    client = clients.client_of_scope(scope)
    if max_in_flight is not None and READY_KEY in scope:
        scope.pop(READY_KEY)()  # counted in flight from here on, not as ready
    if max_in_flight is None:
        counted, limit, reason = clients.start_upload(client), "client_uploads", clients.uploads_refusal
    elif clients.in_flight >= max_in_flight:
        await _refuse(503, in_flight_refusal(max_in_flight), "requests", metrics)(scope, receive, send)
        return None
    else:
        counted, limit, reason = clients.start_request(client), "client_requests", clients.requests_refusal
    if not counted:
        await _refuse(429, _retry(reason), limit, metrics)(scope, receive, send)
        return None
    return client


class UploadLimit:
    """A request body over ``max_bytes`` is answered 413 before the app sees it; one that has not arrived within
    ``timeout`` seconds of the request's start is answered 408; a client with ``clients.max_uploads`` bodies
    arriving already is answered 429 with ``Retry-After`` (``vlfit_refused_total{limit="client_uploads"}``).

    A declared ``Content-Length`` over the limit is refused at once; a body without one (chunked) is read up to the
    limit and refused when it goes beyond. An accepted body is handed to the app, whole, as it was received.
    """

    def __init__(self, app: Any, max_bytes: int, clients: ClientShares, metrics: ServerMetrics,
                 timeout: float | None = None) -> None:  # fmt: skip
        self.app = app
        self.max_bytes = max_bytes
        self.clients = clients
        self.metrics = metrics
        self.timeout = timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        client = await _count(self.clients, self.metrics, scope, receive, send)
        if client is None:
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            message = f"the request body did not arrive within {self.timeout:g} s (--body_timeout)"
            await error_response(408, message, {"Connection": "close"})(scope, receive, send)
            return
        finally:
            self.clients.end_upload(client)
        if body is None:  # the client went away
            return
        if len(body) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Any) -> bytes | None:
        """The body, or the first chunk beyond the limit; ``None`` when the client disconnected."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes or not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        megabytes = self.max_bytes / 1e6
        message = f"the request body is over the upload limit of {megabytes:g} MB (--max_upload_mb)"
        await error_response(413, message)(scope, receive, send)


class InFlightLimit:
    """At most ``max_requests`` requests in flight, and ``clients.max_requests`` of one client; one beyond is
    answered at once (503, or 429 beyond its client's share) with ``Retry-After``, and counted
    (``vlfit_refused_total{limit="requests"}``, ``"client_requests"``), rather than queued behind the others. Inside
    ``UploadLimit``: a request is counted from the end of its body until it is answered.

    ``exempt`` paths (health and metrics: answered on the event loop, microseconds) are never refused, so that a
    monitor sees an overloaded server as up and overloaded, not as down.

    A ceiling: searches are refused earlier by their expected wait (``WaitLimit``).
    """

    def __init__(self, app: Any, max_requests: int, clients: ClientShares, metrics: ServerMetrics,
                 exempt: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.app = app
        self.max_requests = max_requests
        self.clients = clients
        self.metrics = metrics
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        client = await _count(self.clients, self.metrics, scope, receive, send, max_in_flight=self.max_requests)
        if client is None:
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.clients.end_request(client)


class WaitLimit:
    """A ``POST`` to one of ``paths`` (the searches, Weaviate's ``/vectorize``) whose expected wait is over its budget
    (``vlfit.serve.admission``) is answered 503 with ``Retry-After`` at once, once its body is whole (on uvicorn's
    httptools protocol the connection refuses it from its head already), and counted
    (``vlfit_refused_total{limit="wait"}``); every other request passes.

    The kind of a query is read from its head (``query_kind``): on ``/api/search`` a multipart upload is an image
    query, any other body a text query; ``/vectorize`` is a kind of its own. A JSON search whose body holds a base64
    image is moved to the image queue by the route once it parsed the body (``settle_kind``, with the ticket this
    puts in the request's scope under ``TICKET_KEY``). An admitted search is pending from the end of its body until
    its answer is sent, and an answer 200 is timed over the same span: a body still arriving is the client's speed,
    not the queue's, so a client that trickles its bodies cannot make the server refuse the searches of others. On
    uvicorn's httptools protocol its connection enters it (``vlfit.serve.connections``) as it passes it on, its body
    whole, so the heads read in the same turn of the event loop count it ahead of them; this takes that ticket.
    """

    def __init__(self, app: Any, admission: WaitAdmission, metrics: ServerMetrics, paths: tuple[str, ...]) -> None:
        self.app = app
        self.admission = admission
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        kind = query_kind(dict(scope.get("headers") or []).get(b"content-type", b""), scope["path"])
        ticket: Ticket | None = scope.get(TICKET_KEY)  # entered by its connection as it passed it on, its body whole
        if ticket is not None:
            ticket.claimed = True  # left here, as it is answered
        elif (over := self.admission.over_budget(kind)) is not None:  # the connection refused such ones already
            await wait_refusal(kind, over, self.metrics)(scope, receive, send)
            return

        async def pending_from_its_body() -> dict:
            nonlocal ticket
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and ticket is None:
                ticket = self.admission.enter(kind)  # the whole query is here: it waits for the queue now
                scope[TICKET_KEY] = ticket
            return message

        async def status_send(message: dict) -> None:
            if message["type"] == "http.response.start" and ticket is not None:
                ticket.answered = int(message["status"]) == 200  # failures and 499s say nothing of the queue
            await send(message)

        try:
            await self.app(scope, pending_from_its_body, status_send)
        except BaseException:
            if ticket is not None:
                ticket.answered = False
            raise
        finally:
            if ticket is not None:
                self.admission.leave(ticket)


def settle_kind(scope: dict, admission: WaitAdmission | None, metrics: ServerMetrics, kind: str) -> JSONResponse | None:
    """A search admitted from its head as another kind than its body shows (``kind``: a JSON search's base64 image)
    moves to ``kind``'s queue (``WaitAdmission.settle``); the 503 it gets when that queue is over its budget, else
    ``None`` (also without admission, or for a request ``WaitLimit`` did not admit)."""
    ticket = scope.get(TICKET_KEY)
    if admission is None or ticket is None:
        return None
    over = admission.settle(ticket, kind)
    return None if over is None else wait_refusal(kind, over, metrics)


def wait_refusal(kind: str, over: tuple[float, float], metrics: ServerMetrics) -> JSONResponse:
    """The 503 of a query of ``kind`` whose expected wait is over its budget (``over``), counted."""
    return _refuse(503, refusal_message(kind, over), "wait", metrics)


class HeadAsGet:
    """``HEAD`` is answered wherever ``GET`` is: the app answers the ``GET``, and only its head is sent."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def head_only(message: dict) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        as_get = {**scope, "method": "GET"}  # a copy: the server still knows the request as HEAD
        try:
            await self.app(as_get, receive, head_only)
        finally:
            if "route" in as_get:  # for RequestMetrics, outside: the route the GET matched
                scope["route"] = as_get["route"]


class RequestMetrics:
    """Counts every request and its latency by route template and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def recording_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe_request(route, status, time.perf_counter() - started)
