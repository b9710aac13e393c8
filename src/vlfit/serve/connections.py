"""What a connection may hold before it is a request: uvicorn's httptools protocol with the bounds it lacks.

uvicorn (0.3x to 0.5x, on httptools) closes a keep-alive connection idle ``timeout_keep_alive`` seconds after a
response, and with ``limit_concurrency`` answers 503 (counting idle keep-alive connections as load). It does not
bound how long a connection may stay open before its first request, how long a request head may take to arrive, or
how large the head may be (h11's ``h11_max_incomplete_event_size`` bounds the head only on the h11 protocol), and it
accepts connections up to the file-descriptor limit, beyond which clients are refused without a log line.
``BoundedHttpToolsProtocol`` adds, for every connection of a ``vlfit serve`` app:

- ``max_connections``, shared fairly (``vlfit.serve.pool``): when every slot is taken, a connection from an address
  holding fewer than its fair share takes the slot of an idle connection of the address holding the most (closed
  silently between requests or before any, 503 within a head); one that cannot is answered 503 with ``Retry-After``
  and closed, at once, or after ``Retry-After`` where its address holds connections beside other addresses (as
  beyond ``--max_connections_per_client``: reopening at once then costs an accept a second, not thousands; 40,000
  refusals in 10 s fell to 400), logged and counted in ``vlfit_refused_total{limit="connections"}``;
- ``header_timeout``: a request head (request line and headers) must be whole within this many seconds of the
  connection opening or of its first byte; otherwise 408 and close (a connection that never sends a byte is
  closed silently), so idle and trickling connections are let go;
- ``max_header_bytes``: a request line and headers larger than this get 431 and the connection is closed;
- a request over a limit already as its head is parsed (``--max_concurrency`` requests in flight, its client's
  share of them or of bodies arriving, and with ``--max_queue_wait_ms``, on by default, a search whose expected
  wait is over its budget: ``vlfit.serve.admission``) is answered 503 or 429 with ``Retry-After`` before the app
  and its middlewares see it (the body that follows is read and dropped, the connection kept alive), and counted
  in ``vlfit_refused_total`` (not among ``vlfit_requests_total``, which counts what the app answered; the rules
  are ``vlfit.serve.head_admission``'s). Under
  overload most requests are refused; a refusal here costs the event loop a fraction of one through the app, which
  leaves it to the admitted (the middlewares, which count requests once their body is whole, refuse the same way
  on any other protocol);
- a request sent on a connection refused ``REFUSALS_AT_ONCE`` (8) times within the ``Retry-After`` of the first
  of them is held until that is over (so a client that resends at once costs a few refusals a second), but
  started as soon as a slot is given back and it fits, where the time it was held and the expected wait for the
  queue ahead of it together are within its kind's wait budget (``ClientShares.wait_for_room``); a balancer's
  kept-open connection, refused now and then, is answered at once every time;
- a request passed to the app takes its slot of ``--max_concurrency`` from the moment its body is whole
  (``ClientShares.hold_ready``), not only from the app's first step: the heads read in the same turn of the event
  loop see it.

The app hands its ``ServerLimits``, metrics, admission and ``ClientShares`` to the protocol through the lifespan
state (``LIMITS_KEY``, ``METRICS_KEY``, ``ADMISSION_KEY``, ``CLIENTS_KEY``), so every uvicorn worker process reads
those of its own app, whether uvicorn runs one process or several; a connection to an app that gives none is not
bounded here.

The subclass relies on uvicorn's private API (tested on uvicorn 0.54): ``http_protocol`` checks at server start that
what it uses is there (``vlfit.serve.uvicorn_api``: methods and their arguments, the attributes uvicorn's
``__init__`` sets, the status lines it writes). Where something is missing, ``vlfit serve`` logs one warning and
runs on uvicorn's own h11 protocol instead of failing at the first connection: the app's middlewares and query
checks still bound requests and bodies, h11 bounds the head's size, and connections and head time are not bounded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from vlfit.serve.admission import RETRY_AFTER_S, Ticket
from vlfit.serve.clients import ClientShares
from vlfit.serve.disconnects import CLIENT_GONE_KEY
from vlfit.serve.head_admission import HeadAdmission
from vlfit.serve.limits import (
    ADMISSION_KEY,
    CLIENTS_KEY,
    LIMITS_KEY,
    METRICS_KEY,
    ServerLimits,
)
from vlfit.serve.pool import ConnectionRefusals
from vlfit.serve.uvicorn_api import IMPORT_PROBLEM, STATUS_LINE, HttpToolsProtocol, httptools, protocol_api_problems

logger = logging.getLogger(__name__)

# The app protocols of TLS connections still in their handshake, each with the client address it is counted for
# in the app's ClientShares ("" where it is not): vlfit.serve.tls adds them, each leaves as its handshake ends or
# fails. Counted against --max_connections with the connections, and per client as connections are.
tls_handshakes: dict[Any, str] = {}
BOUNDED_PROTOCOL = f"{__name__}:BoundedHttpToolsProtocol"  # uvicorn's http=, as an import string
FALLBACK_PROTOCOL = "h11"  # uvicorn's own, bounding the head's size (h11_max_incomplete_event_size)
# Refusals a connection gets at once within one Retry-After (from the first of them); beyond, a request it sends
# before that Retry-After is over is held (answered then, or started when room comes within its wait budget). A
# client that resends at once costs the server this many refusals a second, not thousands; a balancer's kept-open
# connection, whose next request is another client's, is answered at once. Measured with
# benchmarks/serve_pressure.py --levels resend overload --pin on a 2-core CPU: holding from the first refusal
# (1), 256 kept-open connections at twice capacity waited seconds for a connection (admitted p99 2,862x the
# unloaded p50); 4, 380x; 8, 8.2x, the refusals answered in 1.35 ms (p50), and 128 clients resending at once got
# 0.87 of the best level's answers (0.95 at 1).
REFUSALS_AT_ONCE = 8


def http_protocol(protocol: type | None = None, status_line: Mapping[int, bytes] | None = None) -> str:
    """uvicorn's ``http=`` for ``vlfit serve``: ``BOUNDED_PROTOCOL`` when uvicorn's httptools protocol (or
    ``protocol``, with ``status_line``) has what it needs; else one warning saying which limits are then enforced,
    and uvicorn's own h11 protocol."""
    if protocol is None:
        problems = [IMPORT_PROBLEM] if IMPORT_PROBLEM else protocol_api_problems(HttpToolsProtocol, STATUS_LINE)
    else:
        problems = protocol_api_problems(protocol, STATUS_LINE if status_line is None else status_line)
    if not problems:
        return BOUNDED_PROTOCOL
    import uvicorn

    logger.warning(
        "uvicorn %s's httptools protocol lacks what vlfit's connection limits use (tested on uvicorn 0.54): %s; "
        "serving on uvicorn's h11 protocol: --max_header_bytes is bounded by h11, requests and bodies by vlfit's "
        "middlewares and query checks (--max_concurrency, --max_queue_wait_ms, --max_upload_mb, --body_timeout, "
        "--max_text_chars, --max_query_pixels), idle keep-alive connections by uvicorn (--keep_alive_timeout); "
        "--max_connections and --header_timeout are not enforced",
        getattr(uvicorn, "__version__", "?"),
        "; ".join(problems),
    )
    return FALLBACK_PROTOCOL


class BoundedHttpToolsProtocol(HeadAdmission, HttpToolsProtocol):
    """uvicorn's httptools protocol with a fair connection pool, a request-head timeout and a head size limit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits: ServerLimits | None = self.app_state.get(LIMITS_KEY)
        self.metrics = self.app_state.get(METRICS_KEY)
        self.admission = self.app_state.get(ADMISSION_KEY)
        self.shares: ClientShares | None = self.app_state.get(CLIENTS_KEY)
        self._address = ""  # the peer's address, counted among its connections once admitted
        self._counted_connection = False
        self._pooled = False  # in the pool of open connections (vlfit.serve.pool)
        self._request: tuple[str, bytes, str, bool] = ("", b"", "", False)  # route, content type, client, uploading
        self._retry_at = 0.0  # loop time before which this connection was told to retry (Retry-After)
        self._refusals = 0  # refusals since the first one told to retry before then
        self._held: Any = None  # the timer of a refusal held until then
        self._parked: tuple[Any, Any] | None = None  # the held request's (cycle, app): started if room comes first
        self._parking = False
        self._admit_until = 0.0  # loop time after which the held request is no longer started when room comes
        self._held_connection = False  # refused beyond its client's share, answered after RETRY_AFTER_S
        self._head_bytes = 0
        self._head_timer: Any = None
        self._in_head = False  # between a request's first byte and the end of its headers
        self._admitted = True  # False: refused at the connection cap, never counted among the connections
        self._refused = False  # answered and closed by a limit: nothing more is read
        self._dropping_body = False  # a search refused by its expected wait: its body is read and dropped
        self._target = b""  # the request target, as on_url gives it
        self._ready: Any = None  # the release of this request's count as ready (ClientShares.hold_ready)
        self._ticket: Ticket | None = None  # and its place in its kind's queue (vlfit.serve.admission), if a search

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        handshake_client = tls_handshakes.pop(self, "")  # a TLS connection (vlfit.serve.tls): its handshake is over
        if handshake_client and self.shares is not None:
            self.shares.close_connection(handshake_client)  # counted again below, as the connection it now is
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        limits, shares = self.limits, self.shares
        if limits is not None and self._open_connections() >= limits.max_connections and not self._reclaim_slot():
            ConnectionRefusals.note(limits.max_connections)
            later = shares is not None and shares.pool.holds_some(self._address)  # one of those holding the slots
            self._refuse_connection(transport, "connections", 503, b"too many connections (--max_connections)", later)
            return
        if shares is not None and self._address:
            if not shares.open_connection(self._address):
                message = (f"this client has {shares.max_connections} connections open here "
                           "(--max_connections_per_client); reuse them")  # fmt: skip
                self._refuse_connection(transport, "client_connections", 429, message.encode(), later=True)
                return
            self._counted_connection = True
        super().connection_made(transport)
        if self.shares is not None:
            self.shares.pool.add(self._address, self)
            self._pooled = True
        self._arm_head_timer()  # a connection that never sends a request is let go too

    def _open_connections(self) -> int:
        return len(self.connections) if self.shares is None else self.shares.pool.size

    def _reclaim_slot(self) -> bool:
        """Every slot is taken: take an idle connection's for this one when its address holds fewer than its fair
        share (``vlfit.serve.pool``); True when one was closed for it."""
        shares, limits = self.shares, self.limits
        if shares is None or limits is None or not shares.may_open(self._address):
            return False
        victim = shares.pool.reclaim_for(self._address, limits.max_connections)
        if victim is not None:
            victim.give_up_slot()  # type: ignore[attr-defined]  # the pool holds this class's connections only
        return victim is not None

    def give_up_slot(self) -> None:
        """Closed for a newcomer below its fair share (the pool has let it go already): silently between requests
        or before any (as an idle keep-alive connection is closed), 503 with ``Retry-After`` within a request head."""
        self._pooled = False
        assert self.limits is not None
        ConnectionRefusals.note(self.limits.max_connections, reclaimed=True)
        if self._in_head:
            self._refused = True
            message = b"this connection's slot went to a client holding fewer (--max_connections); retry"
            self._answer_and_close(503, message, retry_after=RETRY_AFTER_S)
        else:
            self.transport.close()

    def _refuse_connection(self, transport: Any, limit: str, status: int, message: bytes, later: bool) -> None:
        """Refuse this connection, counted at ``limit``: answered ``status`` and closed at once, or (``later``: one
        beyond its client's share, or at the server's cap from an address holding connections beside others) after
        ``RETRY_AFTER_S``, reading nothing meanwhile, so a client that opens another as soon as one is closed costs
        the server one accept a second per connection, not thousands (``ClientShares.hold_refusal`` bounds how many
        wait so; beyond, closed at once)."""
        self.transport, self._admitted, self._refused = transport, False, True
        if self.metrics is not None:
            self.metrics.observe_refused(limit)
        if not later:
            self._answer_and_close(status, message, retry_after=RETRY_AFTER_S)
        elif self.shares is not None and self.shares.hold_refusal():
            self._held_connection = True
            transport.pause_reading()
            self._held = self.loop.call_later(RETRY_AFTER_S, self._answer_held_connection, status, message)
        else:
            transport.close()

    def _answer_held_connection(self, status: int, message: bytes) -> None:
        self._held = None
        self._release_held_connection()
        if not self.transport.is_closing():
            self._answer_and_close(status, message, retry_after=RETRY_AFTER_S)

    def _release_held_connection(self) -> None:
        if self._held_connection and self.shares is not None:
            self.shares.release_refusal()
        self._held_connection = False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._release_held_connection()
        if self._held is not None:
            self._held.cancel()
            self._held = None
        self._parked = None
        self._release_ready()
        if self.shares is not None:
            self.shares.stop_waiting(self)
            if self._counted_connection:
                self.shares.close_connection(self._address)
                self._counted_connection = False
            if self._pooled:
                self.shares.pool.remove(self._address, self)
                self._pooled = False
        if self._admitted:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if not self._refused:  # not our own refusal: uvicorn's answer to a callback that failed
                self._invalid_request()
        except httptools.HttpParserError:
            self._invalid_request()
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _invalid_request(self) -> None:
        message = "Invalid HTTP request received."
        self.logger.warning(message)
        self.send_400_response(message)

    def on_message_begin(self) -> None:
        if self._held is not None:  # a request sent before the held refusal was answered: closed after it
            self._refused = True
            return
        super().on_message_begin()
        self._head_bytes, self._in_head, self._target = 0, True, b""
        if self._head_timer is None:  # a keep-alive connection's next request
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        self._target += url
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        self._in_head = False
        if self._pooled:
            assert self.shares is not None
            self.shares.pool.busy(self._address, self)  # a request: never taken for another client's connection
        if self._refused:  # sent behind a held refusal: dropped with the connection
            return
        pipelined = self.cycle is not None and not self.cycle.response_complete  # left to the app's middlewares
        self._request = self._request_of_head()
        refusal = None if pipelined else self._refusal()
        if refusal is None:
            super().on_headers_complete()
            return
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        keep_alive = keep_alive and not self.expect_100_continue  # such a client may not send the body now
        now = self.loop.time()
        if now < self._retry_at and self._refusals >= REFUSALS_AT_ONCE and keep_alive and self.shares is not None:
            # Sent again before the Retry-After it was given, refused REFUSALS_AT_ONCE times since it began: held,
            # its body read into the request as uvicorn makes it, until that time is over (then refused, so a client
            # that resends at once costs the server a few refusals a second, not thousands) or until a slot is given
            # back and it fits, its time held and the queue ahead within its kind's wait budget (started then).
            self._parking = True
            super().on_headers_complete()
            self._parking = False
            if self._parked is not None:
                self._held = self.loop.call_later(self._retry_at - now, self._answer_held, refusal)
                budget = self._wait_budget()
                self._admit_until = self._retry_at if budget is None else now + budget
                self.shares.wait_for_room(self)
                return
        self._refuse(refusal, keep_alive)
        self._dropping_body = True

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        cycle.scope[CLIENT_GONE_KEY] = self.transport.is_closing  # asked before a search's work starts
        if self._parking:
            self._parked = (cycle, app)
        else:
            super()._start_asgi_task(cycle, app)

    def try_admit(self) -> bool | None:
        """A slot was given back (``ClientShares.wait_for_room``): start the held request if it fits now and would
        still be answered within its wait budget of its arrival, the time held and the queue ahead of it together
        (True); None when it waits no more (its connection closing or closed behind another request, or held past
        its wait budget: answered at its Retry-After); False: it still waits."""
        now = self.loop.time()
        if self._parked is None or self._refused or self.transport.is_closing() or now > self._admit_until:
            return None
        if now + self._expected_wait() > self._admit_until or self._refusal() is not None:
            return False  # answered late, or over a limit still: waits on, for a slot given back later
        self._held.cancel()
        self._held = None
        (cycle, app), self._parked = self._parked, None
        self._hold_ready()
        super()._start_asgi_task(cycle, app)
        return True

    def _answer_held(self, refusal: tuple[int, str, str]) -> None:
        self._held = None
        assert self.shares is not None and self._parked is not None
        self.shares.stop_waiting(self)
        (cycle, _), self._parked = self._parked, None
        if self.transport.is_closing():
            return
        cycle.response_complete = True  # never run: uvicorn drops what is still to come of its body
        cycle.body = bytearray()
        self._refuse(refusal, keep_alive=not self._refused)  # a request behind it: not served on this connection
        if not self._refused:
            self.on_response_complete()  # reads on: what is left of its body is dropped, the next request may come

    def _refuse(self, refusal: tuple[int, str, str], keep_alive: bool) -> None:
        """Answer the request ``refusal`` (``(status, message, limit)``), counted; closed unless ``keep_alive``."""
        status, message, limit = refusal
        if self.metrics is not None:
            self.metrics.observe_refused(limit)
        now = self.loop.time()
        if now >= self._retry_at:
            self._retry_at, self._refusals = now + RETRY_AFTER_S, 0
        self._refusals += 1
        self._refused = not keep_alive
        body = json.dumps({"error": message}).encode()
        self._answer(status, body, b"application/json", retry_after=RETRY_AFTER_S, close=not keep_alive)

    def on_body(self, body: bytes) -> None:
        if not self._dropping_body:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._dropping_body:
            if self._parked is None:  # passed to the app (a held one: once it is started, try_admit)
                self._hold_ready()
            super().on_message_complete()
            return
        self._dropping_body = False
        self.on_response_complete()  # as after an answer from the app: keep-alive timer, the next request

    def on_response_complete(self) -> None:
        """An answer was sent (uvicorn's cycle calls this after the app's, the connection after its own): the next
        request may come, and the connection is idle again unless a pipelined one starts now."""
        self._release_ready()
        super().on_response_complete()
        if self._pooled and not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            assert self.shares is not None
            self.shares.pool.idle(self._address, self)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        limits = self.limits
        if limits is not None and self._head_bytes > limits.max_header_bytes:
            self._refused = True
            message = f"the request head is over {limits.max_header_bytes} bytes (--max_header_bytes)"
            self._answer_and_close(431, message.encode())
            raise OverflowError(message)  # stops the parser; data_received knows it was ours

    def _arm_head_timer(self) -> None:
        if self.limits is not None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            assert self.limits is not None
            message = f"the request head did not arrive within {self.limits.header_timeout:g} s (--header_timeout)"
            self._answer_and_close(408, message.encode())
        else:  # nothing sent since the connection opened (or since its last response): no request to answer
            self.transport.close()

    def _answer_and_close(self, status: int, message: bytes, retry_after: int | None = None) -> None:
        self._answer(status, message, b"text/plain; charset=utf-8", retry_after=retry_after, close=True)

    def _answer(self, status: int, body: bytes, content_type: bytes, *, retry_after: int | None, close: bool) -> None:
        """Write a whole answer of the connection's own (no app involved); ``close``: and close the connection."""
        head = [STATUS_LINE[status], b"content-type: %s\r\n" % content_type, b"content-length: %d\r\n" % len(body)]
        if close:
            head.append(b"connection: close\r\n")
        if retry_after is not None:
            head.append(b"retry-after: %d\r\n" % retry_after)
        self.transport.write(b"".join([*head, b"\r\n", body]))
        if close:
            self.transport.close()
