"""``HeadAdmission``: whether a request is taken as its head arrives, before the app and its middlewares see it.

A mixin of ``vlfit.serve.connections.BoundedHttpToolsProtocol``, which reads each request's head and asks here:

- ``_request_of_head``: the request's route, content type, client (``ClientShares.client_of``, through a trusted
  ``X-Forwarded-For``) and whether a body is to come;
- ``_refusal``: ``(status, message, limit)`` where the request is over a limit already (``--max_concurrency``
  requests in flight, the wait a search would meet against its budget, its client's share of requests or of bodies
  arriving), else None;
- ``_hold_ready`` / ``_release_ready``: a request passed to the app takes its slot from the moment its body is
  whole (``ClientShares.hold_ready``) and, if a search, its place in its kind's queue (``vlfit.serve.admission``),
  so that the heads read in the same turn of the event loop see it;
- ``_admitted_kind``, ``_wait_budget``, ``_expected_wait``: the kind of query the wait admission counts it as, that
  kind's budget, and the wait for those of its kind ahead of it (a held request's start, ``try_admit``).
"""

from __future__ import annotations

from typing import Any

from vlfit.serve.admission import TICKET_KEY, Ticket, WaitAdmission, query_kind, refusal_message
from vlfit.serve.clients import READY_KEY, ClientShares
from vlfit.serve.limits import ADMITTED_PATHS, EXEMPT_PATHS, ServerLimits
from vlfit.serve.middleware import in_flight_refusal, share_refusal
from vlfit.serve.uvicorn_api import httptools


class HeadAdmission:
    """The admission of a request at its head (see the module docstring); the connection sets the attributes."""

    limits: ServerLimits | None
    shares: ClientShares | None
    admission: WaitAdmission | None
    _address: str
    _target: bytes
    _request: tuple[str, bytes, str, bool]  # route, content type, client, uploading
    _ready: Any  # the release of the request's count as ready
    _ticket: Ticket | None  # its place in its kind's queue, if a search
    parser: Any
    headers: Any
    cycle: Any
    scope: Any

    def _admitted_kind(self) -> str | None:
        """This request's kind of query in the wait admission (``vlfit.serve.admission``); None where it is not
        admitted by expected wait (no wait admission, or not a search)."""
        route, content_type, _, _ = self._request
        if self.admission is None or route not in ADMITTED_PATHS:
            return None
        return query_kind(content_type, route)

    def _wait_budget(self) -> float | None:
        """The wait budget of this request's kind; None where it has none."""
        kind = self._admitted_kind()
        return None if kind is None else self.admission.budget_for(kind)

    def _expected_wait(self) -> float:
        """Seconds this request, started now, would wait for those of its kind ahead of it (0 where nothing
        measures it)."""
        kind = self._admitted_kind()
        return 0.0 if kind is None else self.admission.expected_wait(kind) or 0.0

    def _request_of_head(self) -> tuple[str, bytes, str, bool]:
        """The request's route, content type, client (``ClientShares.client_of``) and whether a body is to come."""
        headers = dict(self.headers)
        route = httptools.parse_url(self._target).path.decode("latin-1")
        client = self._address
        if self.shares is not None:
            client = self.shares.client_of(self._address, headers.get(b"x-forwarded-for"))
        uploading = headers.get(b"content-length", b"0").strip() not in (b"", b"0") or b"transfer-encoding" in headers
        return route, headers.get(b"content-type", b""), client, uploading

    def _refusal(self) -> tuple[int, str, str] | None:
        """``(status, message, limit)`` when this request is refused here, before the app sees it: what is over a
        limit already (the app's middlewares count the requests and bodies, ``vlfit.serve.middleware``); None: the
        app takes it. Health and metrics are never refused."""
        route, content_type, client, uploading = self._request
        if route in EXEMPT_PATHS:
            return None
        limits, shares = self.limits, self.shares
        if limits is not None and shares is not None and shares.slots_taken >= limits.max_concurrency:
            return 503, in_flight_refusal(limits.max_concurrency), "requests"
        if self.admission is not None and self.parser.get_method() == b"POST" and route in ADMITTED_PATHS:
            kind = query_kind(content_type, route)
            over = self.admission.over_budget(kind)
            if over is not None:
                return 503, refusal_message(kind, over), "wait"
        over_share = None if shares is None else share_refusal(shares, client, uploading=uploading)
        return None if over_share is None else (429, over_share[1], over_share[0])

    def _hold_ready(self) -> None:
        """The request passed to the app has its body whole: its slot is taken from now for the next heads' check,
        until the app counts it in flight or it ends (``ClientShares.hold_ready``). A request behind another
        unanswered one on the connection (pipelined, left to the app's own count) and health checks are not held."""
        if self.shares is None or self._ready is not None:  # one there: the request ahead's, still unanswered
            return
        if self.cycle is None or self.cycle.response_complete:  # answered before its body was whole (a 413)
            return
        route, content_type, client, _ = self._request
        if route in EXEMPT_PATHS:
            return
        self._ready = self.shares.hold_ready(client)
        self.scope[READY_KEY] = self._ready
        if self.admission is not None and route in ADMITTED_PATHS and self.parser.get_method() == b"POST":
            self._ticket = self.admission.enter(query_kind(content_type, route))  # WaitLimit takes it on
            self.scope[TICKET_KEY] = self._ticket

    def _release_ready(self) -> None:
        if self._ready is not None:
            self._ready()
            self._ready = None
        if self._ticket is not None:
            if not self._ticket.claimed and self.admission is not None:  # answered before the app's WaitLimit
                self._ticket.answered = False
                self.admission.leave(self._ticket)
            self._ticket = None
