"""What a connection may hold before it is a request: uvicorn's httptools protocol with the bounds it lacks.

uvicorn (0.3x to 0.5x, on httptools) closes a keep-alive connection idle ``timeout_keep_alive`` seconds after a
response, and with ``limit_concurrency`` answers 503 (counting idle keep-alive connections as load). It does not
bound how long a connection may stay open before its first request, how long a request head may take to arrive, or
how large the head may be (h11's ``h11_max_incomplete_event_size`` bounds the head only on the h11 protocol), and it
accepts connections up to the file-descriptor limit, beyond which clients are refused without a log line.
``BoundedHttpToolsProtocol`` adds, for every connection of a ``vlfit serve`` app:

- ``max_connections``: a connection beyond it is answered 503 with ``Retry-After`` and closed at once (logged,
  counted in ``vlfit_refused_total{limit="connections"}``);
- ``header_timeout``: a request head (request line and headers) must be whole within this many seconds of the
  connection opening or of its first byte; otherwise 408 and close (a connection that never sends a byte is
  closed silently), so idle and trickling connections are let go;
- ``max_header_bytes``: a request line and headers larger than this get 431 and the connection is closed;
- with ``--max_queue_wait_ms`` (on by default), a search whose expected wait is over its budget
  (``vlfit.serve.admission``) is answered 503 with ``Retry-After`` as soon as its head is parsed, before the app and
  its middlewares see it (the body that follows is read and dropped, the connection kept alive), and counted in
  ``vlfit_refused_total{limit="wait"}`` (not among ``vlfit_requests_total``, which counts what the app answered).
  Under overload most requests are refused; a refusal here costs the event loop a fraction of one through the app,
  which leaves it to the admitted (``WaitLimit`` refuses the same way on any other protocol).

The app hands its ``ServerLimits`` and its metrics to the protocol through the lifespan state (``LIMITS_KEY``,
``METRICS_KEY``), so every uvicorn worker process reads those of its own app, whether uvicorn runs one process or
several; a connection to an app that gives none is not bounded here.

The subclass relies on uvicorn's private API (tested on uvicorn 0.54): ``http_protocol`` checks at server start that
what it uses is there (``protocol_api_problems``: methods and their arguments, the attributes uvicorn's
``__init__`` sets, the status lines it writes). Where something is missing, ``vlfit serve`` logs one warning and runs
on uvicorn's own h11 protocol instead of failing at the first connection: the app's middlewares and query checks
still bound requests and bodies, h11 bounds the head's size, and connections and head time are not bounded.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import logging
import textwrap
import time
from collections.abc import Mapping
from typing import Any

from vlfit.errors import first_line
from vlfit.serve.admission import RETRY_AFTER_S, query_kind, refusal_message
from vlfit.serve.clients import ClientShares
from vlfit.serve.limits import (
    ADMISSION_KEY,
    ADMITTED_PATHS,
    CLIENTS_KEY,
    EXEMPT_PATHS,
    LIMITS_KEY,
    METRICS_KEY,
    ServerLimits,
)

try:  # uvicorn's private protocol module: where it moved or went, http_protocol() falls back to h11
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError as error:
    IMPORT_PROBLEM: str | None = f"uvicorn.protocols.http.httptools_impl: {first_line(error)}"
    STATUS_LINE, HttpToolsProtocol = {}, object  # type: ignore[assignment,misc]
else:
    IMPORT_PROBLEM = None

logger = logging.getLogger(__name__)

# The app protocols of TLS connections still in their handshake, each with the client address it is counted for
# in the app's ClientShares ("" where it is not): vlfit.serve.tls adds them, each leaves as its handshake ends or
# fails. Counted against --max_connections with the connections, and per client as connections are.
tls_handshakes: dict[Any, str] = {}
REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most this often, with the count since
BOUNDED_PROTOCOL = f"{__name__}:BoundedHttpToolsProtocol"  # uvicorn's http=, as an import string
FALLBACK_PROTOCOL = "h11"  # uvicorn's own, bounding the head's size (h11_max_incomplete_event_size)
# What BoundedHttpToolsProtocol uses of uvicorn's protocol: the methods it overrides or calls, each with the number of
# arguments it passes; the attributes uvicorn's __init__ sets that it reads; the status lines it writes.
PROTOCOL_METHODS = {
    "connection_made": 1, "connection_lost": 1, "data_received": 1, "on_message_begin": 0, "on_url": 1,
    "on_header": 2, "on_headers_complete": 0, "_unset_keepalive_if_required": 0, "_should_upgrade": 0,
    "handle_websocket_upgrade": 0, "_unsupported_upgrade_warning": 0, "send_400_response": 1, "on_body": 1,
    "on_message_complete": 0, "on_response_complete": 0,
}  # fmt: skip
PROTOCOL_KEYWORDS = ("config", "server_state", "app_state")  # how uvicorn creates a protocol per connection
PROTOCOL_ATTRIBUTES = ("app_state", "connections", "tasks", "parser", "loop", "logger", "transport", "cycle",
                       "headers", "expect_100_continue")  # fmt: skip
STATUS_CODES = (408, 429, 431, 503)


def protocol_api_problems(protocol: type, status_line: Mapping[int, bytes]) -> list[str]:
    """What ``BoundedHttpToolsProtocol`` needs and ``protocol`` (uvicorn's ``HttpToolsProtocol``) lacks: a missing
    method, one that does not take the arguments passed, an attribute its ``__init__`` does not set, a status
    line ``status_line`` (uvicorn's ``STATUS_LINE``) does not hold; empty when everything is there."""
    problems = []
    for name, count in {"__init__": 0, **PROTOCOL_METHODS}.items():
        method = getattr(protocol, name, None)
        if not callable(method):
            problems.append(f"no {name}()")
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: nothing to check
        keywords = dict.fromkeys(PROTOCOL_KEYWORDS) if name == "__init__" else {}
        try:
            signature.bind(None, *[None] * count, **keywords)
        except TypeError:
            passed = ", ".join(f"{key}=" for key in keywords) if keywords else f"{count} argument(s)"
            problems.append(f"{name}{signature} does not take {passed}")
    assigned = _assigned_attributes(protocol)
    problems += [f"no self.{name}" for name in PROTOCOL_ATTRIBUTES if name not in assigned]
    problems += [f"no STATUS_LINE[{code}]" for code in STATUS_CODES if code not in status_line]
    return problems


def _assigned_attributes(protocol: type) -> set[str]:
    """The attributes of ``protocol``'s class and those its ``__init__`` methods (along the MRO) assign."""
    names = {name for cls in protocol.__mro__ for name in vars(cls)}
    for cls in protocol.__mro__:
        init = vars(cls).get("__init__")
        if init is not None and cls is not object:
            with contextlib.suppress(OSError, TypeError, SyntaxError):  # no source: its attributes count as missing
                tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
                names.update(
                    node.attr
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                )
    return names


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


class ConnectionRefusals:
    """A count of refused connections, logged once per interval rather than once per connection."""

    count = 0
    logged_at = 0.0

    @classmethod
    def note(cls, limit: int) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls.logged_at >= REFUSAL_LOG_INTERVAL_S:
            logger.warning("refused %d connection(s) over the limit of %d open (--max_connections)", cls.count, limit)
            cls.count, cls.logged_at = 0, now


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap, a request-head timeout and a head size limit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits: ServerLimits | None = self.app_state.get(LIMITS_KEY)
        self.metrics = self.app_state.get(METRICS_KEY)
        self.admission = self.app_state.get(ADMISSION_KEY)
        self.shares: ClientShares | None = self.app_state.get(CLIENTS_KEY)
        self._address = ""  # the peer's address, counted among its connections once admitted
        self._counted_connection = False
        self._requests: list[str] = []  # the client of each request handed to the app and not yet answered
        self._retry_at = 0.0  # loop time before which this connection was told to retry (Retry-After)
        self._held: Any = None  # the timer of a refusal held until then
        self._held_body_done = False  # the held request's body was read (and dropped)
        self._held_connection = False  # refused beyond its client's share, answered after RETRY_AFTER_S
        self._head_bytes = 0
        self._head_timer: Any = None
        self._in_head = False  # between a request's first byte and the end of its headers
        self._admitted = True  # False: refused at the connection cap, never counted among the connections
        self._refused = False  # answered and closed by a limit: nothing more is read
        self._dropping_body = False  # a search refused by its expected wait: its body is read and dropped
        self._target = b""  # the request target, as on_url gives it

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        handshake_client = tls_handshakes.pop(self, "")  # a TLS connection (vlfit.serve.tls): its handshake is over
        if handshake_client and self.shares is not None:
            self.shares.close_connection(handshake_client)  # counted again below, as the connection it now is
        limits = self.limits
        if limits is not None and len(self.connections) >= limits.max_connections:
            self.transport, self._admitted, self._refused = transport, False, True
            ConnectionRefusals.note(limits.max_connections)
            if self.metrics is not None:
                self.metrics.observe_refused("connections")
            self._answer_and_close(503, b"too many connections (--max_connections)", retry_after=1)
            return
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if self.shares is not None and self._address:
            if not self.shares.open_connection(self._address):
                self.transport, self._admitted, self._refused = transport, False, True
                if self.metrics is not None:
                    self.metrics.observe_refused("client_connections")
                message = (f"this client has {self.shares.max_connections} connections open here "
                           "(--max_connections_per_client); reuse them")  # fmt: skip
                self._refuse_connection_later(message.encode())
                return
            self._counted_connection = True
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends a request is let go too

    def _refuse_connection_later(self, message: bytes) -> None:
        """Answer a connection beyond its client's share 429 after ``RETRY_AFTER_S``, reading nothing meanwhile: a
        client that opens another as soon as one is closed then costs the server one accept a second per
        connection, not thousands (``ClientShares.hold_refusal`` bounds how many wait so; beyond, closed at once)."""
        assert self.shares is not None
        if not self.shares.hold_refusal():
            self.transport.close()
            return
        self._held_connection = True
        self.transport.pause_reading()
        self._held = self.loop.call_later(RETRY_AFTER_S, self._answer_held_connection, message)

    def _answer_held_connection(self, message: bytes) -> None:
        self._held = None
        self._release_held_connection()
        if not self.transport.is_closing():
            self._answer_and_close(429, message, retry_after=RETRY_AFTER_S)

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
        if self.shares is not None:
            if self._counted_connection:
                self.shares.close_connection(self._address)
                self._counted_connection = False
            for client in self._requests:  # requests whose answers will not be sent
                self.shares.end_request(client)
            self._requests = []
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
        if self._refused:  # sent behind a held refusal: dropped with the connection
            return
        refusal = self._refusal()
        if refusal is None:
            super().on_headers_complete()
            return
        status, message, limit = refusal
        if self.metrics is not None:
            self.metrics.observe_refused(limit)
        self._dropping_body = True
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        keep_alive = keep_alive and not self.expect_100_continue  # such a client may not send the body now
        body = json.dumps({"error": message}).encode()
        now = self.loop.time()
        if now < self._retry_at:
            # Sent again before the Retry-After it was given: answered once that time is over, so a client that
            # resends at once costs the server one refusal a second, not thousands (its body is read meanwhile).
            self._held_body_done = False
            self._held = self.loop.call_later(self._retry_at - now, self._answer_held, status, body, keep_alive)
            return
        self._retry_at = now + RETRY_AFTER_S
        self._refused = not keep_alive
        self._answer(status, body, b"application/json", retry_after=RETRY_AFTER_S, close=not keep_alive)

    def _answer_held(self, status: int, body: bytes, keep_alive: bool) -> None:
        self._held = None
        if self.transport.is_closing():
            return
        close = not keep_alive or self._refused  # another request came behind it: not served on this connection
        self._retry_at = self.loop.time() + RETRY_AFTER_S
        self._refused = self._refused or close
        self._answer(status, body, b"application/json", retry_after=RETRY_AFTER_S, close=close)
        if not close and self._held_body_done:
            self._held_body_done = False
            super().on_response_complete()  # the next request may come

    def _refusal(self) -> tuple[int, str, str] | None:
        """``(status, message, limit)`` when this request is refused here, before the app sees it; None: the app
        takes it (and it is counted among its client's requests in flight). A request pipelined behind one still
        in the app is left to the app (its middlewares refuse the same way). Health and metrics are never refused.
        """
        if self.cycle is not None and not self.cycle.response_complete:
            return None
        path = httptools.parse_url(self._target).path
        if path.decode("latin-1") in EXEMPT_PATHS:
            return None
        limits = self.limits
        if limits is not None and len(self.tasks) >= limits.max_concurrency:
            return 503, (f"the server is answering its limit of {limits.max_concurrency} requests "
                         f"(--max_concurrency); retry after {RETRY_AFTER_S} s"), "requests"  # fmt: skip
        route = path.decode("latin-1")
        if self.admission is not None and self.parser.get_method() == b"POST" and route in ADMITTED_PATHS:
            kind = query_kind(dict(self.headers).get(b"content-type", b""), route)
            over = self.admission.over_budget(kind)
            if over is not None:
                return 503, refusal_message(kind, over), "wait"
        if self.shares is not None:
            client = self.shares.client_of(self._address, dict(self.headers).get(b"x-forwarded-for"))
            if not self.shares.start_request(client):
                message = (f"this client has {self.shares.max_requests} requests in flight here "
                           f"(--max_concurrency_per_client); retry after {RETRY_AFTER_S} s")  # fmt: skip
                return 429, message, "client_requests"
            self._requests.append(client)
        return None

    def on_response_complete(self) -> None:
        """An answer of the app was sent (uvicorn's cycle calls this): its request is no longer in flight."""
        if self._requests:
            assert self.shares is not None
            self.shares.end_request(self._requests.pop(0))
        super().on_response_complete()

    def on_body(self, body: bytes) -> None:
        if not self._dropping_body:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._dropping_body:
            super().on_message_complete()
            return
        self._dropping_body = False
        if self._held is not None:  # answered when its hold is over
            self._held_body_done = True
            return
        super().on_response_complete()  # as after an answer from the app: keep-alive timer, the next request

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
