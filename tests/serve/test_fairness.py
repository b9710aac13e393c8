"""A few clients cannot shut out the rest: addresses that hold and reopen idle connections up to the server's cap
leave another address answered (its connection takes an idle one's slot), bodies that trickle in hold no search
slot, and a refusal held on a kept-open connection is started as soon as the server has room.

The first two run against the real ``vlfit serve`` process (clients told apart by their loopback source address,
127.0.0.N); the third against the real app and protocol under uvicorn in this process, whose encoder the test holds
so that requests stay in flight as long as it needs. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.serve.test_clients import _connect, _held, _metric, _search
from tests.serve.test_limits import RecordingEngine
from tests.serve.test_server import _read_response

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
MAX_CONNECTIONS = 40
CONCURRENCY = 4
UPLOADS_PER_CLIENT = 16
HOG_ADDRESSES = [f"127.0.3.{n}" for n in range(1, 10)]  # 9 addresses
HOG_CONNECTIONS = 8  # each, 72 in all: more than the server's 40
QUERIES = 20
ANSWERED_FRACTION = 0.95


@pytest.fixture(scope="module")
def server(served_index: Path, tmp_path_factory):
    from vlfit.serve.launch import kill_process_tree, start_server

    log = tmp_path_factory.mktemp("fairness") / "server.log"
    flags = ["--index", str(served_index), "--reload_interval", "0", "--max_connections", str(MAX_CONNECTIONS),
             "--max_concurrency", str(CONCURRENCY), "--max_uploads_per_client", str(UPLOADS_PER_CLIENT),
             "--header_timeout", "5"]  # fmt: skip
    started = start_server(flags, str(log), timeout=START_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        yield started
    finally:
        kill_process_tree(started.process)


class Hogs:
    """``per_address`` connections from each of ``addresses`` that send nothing, each opened again as soon as the
    server closes it, on an event loop of their own thread (while inside ``with``)."""

    def __init__(self, port: int, addresses: list[str], per_address: int) -> None:
        self.port, self.addresses, self.per_address = port, addresses, per_address
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._hold_all()), daemon=True)

    def __enter__(self) -> Hogs:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    async def _hold_all(self) -> None:
        await asyncio.gather(*(self._hold(address) for address in self.addresses for _ in range(self.per_address)))

    async def _hold(self, address: str) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.port, local_addr=(address, 0)), 5
                )
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(0.01)
                continue
            while not self._stop.is_set():
                try:
                    if not await asyncio.wait_for(reader.read(1 << 16), 0.2):
                        break
                except asyncio.TimeoutError:
                    continue
                except OSError:
                    break
            else:
                writer.close()
                return
            self.closed_by_server += 1
            writer.close()


def _fraction_answered(port: int, source: str, caption: str, *, fresh: bool) -> float:
    """``QUERIES`` searches from ``source``, one after another (each on a connection of its own if ``fresh``, else
    on one kept open and opened again when the server closes it): the fraction answered 200."""
    answered, connection = 0, None
    for _ in range(QUERIES):
        try:
            if connection is None:
                connection = _connect(port, source)
            connection.sendall(_search(caption))
            answer = _read_response(connection)
        except OSError:
            answer = b""
        answered += answer.startswith(b"HTTP/1.1 200")
        if fresh or not answer or b"connection: close" in answer.lower():
            if connection is not None:
                connection.close()
            connection = None
    if connection is not None:
        connection.close()
    return answered / QUERIES


def test_addresses_holding_every_connection_slot_leave_another_address_answered(server, train_records) -> None:
    caption = train_records[4].caption
    with Hogs(server.port, HOG_ADDRESSES, HOG_CONNECTIONS) as hogs:
        time.sleep(2.0)  # the 9 addresses hold every slot, and reopen what is closed
        started = time.monotonic()
        fraction = _fraction_answered(server.port, "127.0.3.100", caption, fresh=True)
        took = time.monotonic() - started
        closed = hogs.closed_by_server
    assert fraction >= ANSWERED_FRACTION, f"{fraction:.0%} of a tenth address's queries answered"
    assert took < 10 and closed > 0  # idle connections of the hogs were closed for it
    # The hogs' connections refused at the cap are answered after their Retry-After: about one closed a second
    # for each of the 32 beyond the cap (39/s seen), not thousands (3,000/s when answered at once).
    assert closed / (took + 2.0) < 300, f"{closed} hog connections closed in {took + 2.0:.1f} s"
    time.sleep(0.5)
    assert _fraction_answered(server.port, "127.0.3.9", caption, fresh=False) == 1.0  # a hog, quiet again


def test_bodies_arriving_slowly_hold_no_search_slot(server, train_records) -> None:
    """32 requests from 2 addresses sending their bodies a byte at a time take no slot of --max_concurrency (4):
    another address's searches are answered meanwhile; the slow ones, once whole, are answered too."""
    caption = train_records[5].caption
    slow: list[tuple[socket.socket, bytes]] = []
    uploads_before = _metric(server.url, "vlfit_refused_total", 'limit="client_uploads"')
    try:
        slow = [_held(server.port, f"127.0.4.{1 + n % 2}", caption) for n in range(32)]
        for _ in range(3):  # a byte at a time, well within --body_timeout
            time.sleep(0.2)
            for index, (connection, rest) in enumerate(slow):
                connection.sendall(rest[:1])
                slow[index] = (connection, rest[1:])
        assert _fraction_answered(server.port, "127.0.4.100", caption, fresh=False) >= ANSWERED_FRACTION
        for connection, rest in slow[:CONCURRENCY]:  # whole now: ready to run, each takes a slot
            connection.sendall(rest)
        for connection, _ in slow[:CONCURRENCY]:
            assert _read_response(connection).startswith(b"HTTP/1.1 200")
    finally:
        for connection, _ in slow:
            connection.close()
    assert _metric(server.url, "vlfit_refused_total", 'limit="client_uploads"') == uploads_before  # 16 each fit


class HeldEngine(RecordingEngine):
    """``hold`` makes every text batch wait, and ``slow`` those with a text that starts with "slow"."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.slow = threading.Event()
        self.slow.set()

    def encode_texts(self, texts, times=None):
        if any(text.startswith("slow") for text in texts):
            assert self.slow.wait(30)
        return super().encode_texts(texts, times)


@pytest.fixture(scope="module")
def held_engine(served_index: Path) -> HeldEngine:
    return HeldEngine(str(served_index))


@contextlib.contextmanager
def _in_process_server(engine: RecordingEngine, **limits: object):
    """The app of ``engine`` with ``limits`` under uvicorn on vlfit's connection protocol, in a thread of this
    process, on a free loopback port; yields the port and the server's event loop."""
    import uvicorn

    from vlfit.serve.app import create_app
    from vlfit.serve.connections import BoundedHttpToolsProtocol
    from vlfit.serve.limits import ServerLimits

    app = create_app(engine, reload_interval=0, limits=ServerLimits(**limits))  # type: ignore[arg-type]
    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=BoundedHttpToolsProtocol, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        yield listener.getsockname()[1], server.servers[0].get_loop()
    finally:
        engine.hold.set()
        server.should_exit = True
        thread.join(15)
        listener.close()


def _refused_at_once(connection: socket.socket, times: int) -> None:
    for _ in range(times):
        sent = time.monotonic()
        connection.sendall(_search("one red circle"))
        answer = _read_response(connection)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max_concurrency" in answer, answer
        assert time.monotonic() - sent < 0.5, "a refusal within the connection's first few was held"


def test_a_refusal_held_on_a_kept_open_connection_is_started_as_soon_as_there_is_room(held_engine) -> None:
    """With the one slot in flight, a kept-open connection is refused at once REFUSALS_AT_ONCE times; its next
    request, sent before the first refusal's Retry-After is over, waits for it (503 once it is over while the slot
    stays taken); refused so again, the one after is started as the slot is given back, not a second later."""
    from vlfit.serve.connections import REFUSALS_AT_ONCE

    with _in_process_server(held_engine, max_concurrency=1, max_concurrency_per_client=1) as (port, _):
        held_engine.hold.clear()  # the encoder waits: a search stays in flight
        blocker = _connect(port, "127.0.0.2")
        blocker.sendall(_search("the search in flight"))
        time.sleep(0.5)
        pooled = _connect(port, "127.0.0.3")  # a balancer's kept-open connection
        _refused_at_once(pooled, REFUSALS_AT_ONCE)
        sent = time.monotonic()
        pooled.sendall(_search("one red circle"))  # one more at once: held until its Retry-After, no room came
        held = _read_response(pooled)
        assert held.startswith(b"HTTP/1.1 503") and 0.3 < time.monotonic() - sent < 10, held[:100]
        _refused_at_once(pooled, REFUSALS_AT_ONCE - 1)  # the held one was the first of its second
        sent = time.monotonic()
        pooled.sendall(_search("one red circle"))  # held again; the slot is given back 0.2 s later
        time.sleep(0.2)
        held_engine.hold.set()
        started = _read_response(pooled)
        waited = time.monotonic() - sent
        assert started.startswith(b"HTTP/1.1 200"), started[:200]
        assert waited < 0.8, f"held {waited:.2f} s after the slot was given back 0.2 s after it was sent"
        assert _read_response(blocker).startswith(b"HTTP/1.1 200")
        blocker.close()
        pooled.close()


def test_a_held_request_is_not_started_where_its_time_held_and_the_queue_ahead_pass_its_budget(held_engine) -> None:
    """With a wait budget of 0.5 s and a text query measured at about 0.4 s: a request held on a kept-open connection
    is not started when a slot is given back 0.2 s after it was sent while another query is still ahead of it
    (0.2 s held and 0.4 s ahead: over its budget of its arrival); it is answered 503 at its Retry-After. (Started
    there, it waited behind that query: a held request admitted near the end of its budget was answered at the
    budget and a queue's time after it, which made the p99 of 128 clients resending at once 12.6x the unloaded
    p50.)"""
    from vlfit.serve.connections import REFUSALS_AT_ONCE

    limits = {"max_concurrency": 2, "max_concurrency_per_client": 2, "max_queue_wait_ms": 500}
    with _in_process_server(held_engine, **limits) as (port, _):
        held_engine.hold.clear()
        threading.Timer(0.4, held_engine.hold.set).start()  # the first query is answered in about 0.4 s
        with _connect(port, "127.0.0.50") as first:
            first.sendall(_search("a first query"))
            assert _read_response(first).startswith(b"HTTP/1.1 200")
        held_engine.hold.clear()
        in_flight = _connect(port, "127.0.0.51")
        in_flight.sendall(_search("the search in flight"))
        time.sleep(0.3)
        held_engine.slow.clear()
        queued = _connect(port, "127.0.0.52")
        queued.sendall(_search("slow: the search queued behind it"))
        time.sleep(0.3)
        pooled = _connect(port, "127.0.0.53")
        _refused_at_once(pooled, REFUSALS_AT_ONCE)
        sent = time.monotonic()
        pooled.sendall(_search("one red circle"))  # held
        time.sleep(0.2)
        held_engine.hold.set()  # the search in flight is answered: a slot given back, the slow one still ahead
        threading.Timer(1.5, held_engine.slow.set).start()
        assert _read_response(in_flight).startswith(b"HTTP/1.1 200")
        held = _read_response(pooled)
        assert held.startswith(b"HTTP/1.1 503") and b"--max_concurrency" in held, held[:300]
        assert time.monotonic() - sent < 1.4, "answered only after the query ahead of it"
        assert _read_response(queued).startswith(b"HTTP/1.1 200")
        for connection in (in_flight, queued, pooled):
            connection.close()


def test_a_search_whose_client_hung_up_before_its_turn_is_never_computed(held_engine) -> None:
    """Through vlfit's connection protocol, which tells the app whether a request's client is gone: a search sent
    and its connection closed while the event loop was busy is read with its hang-up, answered by nobody and never
    embedded; the next search is."""
    from tests.serve.test_clients import TIMEOUT

    with _in_process_server(held_engine, max_concurrency=8) as (port, loop):
        asleep = threading.Event()
        loop.call_soon_threadsafe(lambda: (asleep.set(), time.sleep(0.5)))  # the loop busy while the client leaves
        assert asleep.wait(TIMEOUT)
        with _connect(port, "127.0.0.60") as gone:
            gone.sendall(_search("a search whose client hung up"))
        time.sleep(1.0)
        with _connect(port, "127.0.0.61") as after:
            after.sendall(_search("a search still waited for"))
            assert _read_response(after).startswith(b"HTTP/1.1 200")
    assert "a search still waited for" in held_engine.embedded
    assert "a search whose client hung up" not in held_engine.embedded


@pytest.mark.parametrize(
    ("limits", "admitted", "says"),
    [({"max_concurrency": 2}, 2, b"--max_concurrency"), ({"max_queue_wait_ms": 0.001}, 1, b"over the budget of")],
    ids=["max_concurrency", "wait_budget"],
)
def test_searches_read_together_beyond_a_limit_are_refused_by_their_connections(held_engine, limits, admitted,
                                                                                says) -> None:  # fmt: skip
    """Six searches that the event loop reads in one turn, beyond two slots, or beyond a wait budget of 1 us once one
    is pending: those within are admitted and the rest refused from their heads by their connections, none by the
    app. (A request counted in flight and in its queue only at its first step in the app, after the loop has parsed
    the others read with it, let all six pass the heads' checks, and the app refused the rest, each at several
    times the cost of a refusal from the head.)"""
    from tests.serve.test_clients import TIMEOUT

    with _in_process_server(held_engine, max_concurrency_per_client=8, **limits) as (port, loop):
        with _connect(port, "127.0.0.9") as first:  # one answered: the wait per query is measured
            first.sendall(_search("a first query"))
            assert _read_response(first).startswith(b"HTTP/1.1 200")
        held_engine.hold.clear()  # the encoder waits: the admitted stay in flight
        connections = [_connect(port, f"127.0.0.{10 + n}") for n in range(6)]
        asleep = threading.Event()
        loop.call_soon_threadsafe(lambda: (asleep.set(), time.sleep(0.5)))  # the loop busy while all six arrive
        assert asleep.wait(TIMEOUT)
        for n, connection in enumerate(connections):
            connection.sendall(_search(f"query {n}"))
        time.sleep(1.0)  # the loop awake again: the refusals answered, the admitted waiting for the encoder
        held_engine.hold.set()
        answers = [_read_response(connection) for connection in connections]
        for connection in connections:
            connection.close()
    refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503")]
    assert len(refused) == 6 - admitted and sum(answer.startswith(b"HTTP/1.1 200") for answer in answers) == admitted
    assert all(says in answer for answer in refused), refused
    # What the app answers goes out through uvicorn's cycle, which adds its date and server headers; a refusal the
    # connection writes from the head has neither.
    assert not [answer for answer in refused if b"\r\nserver: uvicorn" in answer.lower()], refused


def test_slots_and_queue_places_of_requests_whose_clients_went_away_are_given_back(held_engine) -> None:
    """With one slot and a wait budget: searches whose clients hang up while they are in flight, and one answered
    before its body is whole (413: over --max_upload_mb; its connection still reading the rest), leave the slot and
    the queue as they found them: the searches after them are answered at once."""
    with _in_process_server(held_engine, max_concurrency=1, max_concurrency_per_client=1) as (port, _):
        for n in range(3):
            held_engine.hold.clear()  # the encoder waits: the search stays in flight until its client is gone
            with _connect(port, f"127.0.0.{20 + n}") as gone:
                gone.sendall(_search(f"a query whose client hangs up {n}"))
                time.sleep(0.3)
            held_engine.hold.set()
            time.sleep(0.3)
        with _connect(port, "127.0.0.30") as oversized:  # kept open while the searches after it are sent
            body = b'{"text": "' + b"x" * (21 * 1000 * 1000) + b'"}'
            head = b"POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            oversized.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
            with contextlib.suppress(OSError):
                oversized.sendall(body)
            assert _read_response(oversized).startswith(b"HTTP/1.1 413")
            time.sleep(0.5)  # the rest of its body read by its connection
            for n in range(3):
                with _connect(port, f"127.0.0.{40 + n}") as after:
                    after.sendall(_search(f"one red circle {n}"))
                    answer = _read_response(after)
                    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
