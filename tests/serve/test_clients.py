"""Capacity under pressure, on the real ``vlfit serve`` process: one client address cannot take the connection
slots of the others, bodies still arriving are counted per client and take no slot of ``--max_concurrency``, and
HTTPS handshakes are bounded in time and counted against ``--max_connections``. (Requests beyond
``--max_concurrency`` refused by their connection, and sent again before their ``Retry-After``: test_fairness.py.)

Clients are told apart by their loopback source address (127.0.0.2, 127.0.0.3, ...: all of 127/8 is this machine).
Every request and wait has a timeout; the servers are stopped by the module."""

from __future__ import annotations

import json
import re
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.test_server import _read_response

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
TIMEOUT = 30
PER_CLIENT_CONNECTIONS = 3
CONCURRENCY = 4
PER_CLIENT_REQUESTS = 2
HEADER_TIMEOUT = 3
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def server(served_index: Path, tmp_path_factory):
    from vlfit.serve.launch import kill_process_tree, start_server

    log = tmp_path_factory.mktemp("clients") / "server.log"
    flags = ["--index", str(served_index), "--reload_interval", "0", "--max_connections_per_client",
             str(PER_CLIENT_CONNECTIONS), "--max_concurrency", str(CONCURRENCY), "--max_concurrency_per_client",
             str(PER_CLIENT_REQUESTS), "--header_timeout", str(HEADER_TIMEOUT)]  # fmt: skip
    started = start_server(flags, str(log), timeout=START_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        yield started
    finally:
        kill_process_tree(started.process)


def _connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT, source_address=(source, 0))


def _search(caption: str) -> bytes:
    body = json.dumps({"text": caption, "k": 2}).encode()
    head = "POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _held(port: int, source: str, caption: str) -> tuple[socket.socket, bytes]:
    """A search from ``source`` with its body all but sent: its body arriving until the rest (returned) is sent."""
    request = _search(caption)
    connection = _connect(port, source)
    connection.sendall(request[: len(request) - 5])
    return connection, request[len(request) - 5 :]


def _ask(port: int, source: str, request: bytes) -> bytes:
    with _connect(port, source) as connection:
        connection.sendall(request)
        return _read_response(connection)


def _metric(base: str, name: str, label: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    found = re.search(rf"^{name}\{{{label}\}} (\S+)$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def test_one_address_holding_its_connections_leaves_the_others_theirs(server, train_records) -> None:
    hog = [_connect(server.port, "127.0.0.2") for _ in range(PER_CLIENT_CONNECTIONS)]  # silent, as a hog is
    try:
        with _connect(server.port, "127.0.0.2") as extra:
            opened = time.monotonic()
            refused = _read_response(extra)
            assert refused.startswith(b"HTTP/1.1 429") and b"--max_connections_per_client" in refused, refused
            assert time.monotonic() - opened >= 0.9  # answered after its Retry-After, not at once
            assert extra.recv(1) == b""  # and closed
        answer = _ask(server.port, "127.0.0.3", _search(train_records[0].caption))
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        for connection in hog:
            connection.close()
    time.sleep(0.3)  # the server has seen them close: the address has its share again
    assert _ask(server.port, "127.0.0.2", _search(train_records[1].caption)).startswith(b"HTTP/1.1 200")
    assert _metric(server.url, "vlfit_refused_total", 'limit="client_connections"') >= 1


def test_bodies_arriving_are_counted_per_client_and_take_no_request_slot(server, train_records) -> None:
    """Requests whose bodies are still arriving count against their client's share of bodies (by default its share
    of requests in flight, PER_CLIENT_REQUESTS), refused at the head beyond it, and hold no slot of
    --max_concurrency: more of them than CONCURRENCY leave another client's search answered."""
    base, port = server.url, server.port
    caption = train_records[2].caption
    answered_before = _metric(base, "vlfit_requests_total", 'route="/api/search",status="200"')
    held = [_held(port, "127.0.0.2", caption) for _ in range(PER_CLIENT_REQUESTS)]
    try:
        time.sleep(0.5)  # both in the app, waiting for their bodies
        over = _ask(port, "127.0.0.2", _search(caption))  # this client's third body
        assert over.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in over.lower(), over
        assert b"--max_uploads_per_client" in over
        image = b"GET /api/image/0?size=32 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # no body: the client's share
        assert _ask(port, "127.0.0.2", image).startswith(b"HTTP/1.1 200")  # of requests in flight is untouched
        held += [_held(port, address, caption) for address in ("127.0.0.3", "127.0.0.4") for _ in range(2)]
        time.sleep(0.5)  # 6 bodies arriving, over the server's CONCURRENCY: its slots are free still
        assert _ask(port, "127.0.0.5", _search(caption)).startswith(b"HTTP/1.1 200")
    finally:
        for connection, rest in held:  # one after another: each takes a slot once whole, until answered
            with connection:
                connection.sendall(rest)
                assert _read_response(connection).startswith(b"HTTP/1.1 200")
    # The refusal never reached the app: what it answered is the held requests and the other client's.
    answered = _metric(base, "vlfit_requests_total", 'route="/api/search",status="200"') - answered_before
    assert answered == len(held) + 1
    assert _metric(base, "vlfit_refused_total", 'limit="client_uploads"') >= 1
    assert not re.search(r'status="(503|429)"', httpx.get(f"{base}/metrics", timeout=TIMEOUT).text)


def test_a_trusted_proxy_names_its_clients_and_an_untrusted_one_does_not() -> None:
    from vlfit.errors import ConfigError
    from vlfit.serve.clients import ClientShares

    shares = ClientShares(2, 1, forwarded_allow_ips="127.0.0.1, 10.0.0.0/8")
    assert shares.client_of("127.0.0.1", b"203.0.113.9, 10.1.2.3") == "203.0.113.9"  # the last untrusted hop
    assert shares.client_of("127.0.0.1", b"spoofed, 198.51.100.7") == "198.51.100.7"
    assert shares.client_of("192.0.2.5", b"203.0.113.9") == "192.0.2.5"  # not a trusted proxy: its own address
    assert all(shares.open_connection("127.0.0.1") for _ in range(5))  # a proxy's connections carry many clients
    assert shares.open_connection("192.0.2.5") and shares.open_connection("192.0.2.5")
    assert not shares.open_connection("192.0.2.5")
    assert shares.start_request("203.0.113.9") and not shares.start_request("203.0.113.9")
    shares.end_request("203.0.113.9")
    assert shares.start_request("203.0.113.9")
    assert ClientShares(1, 1).client_of("127.0.0.1", b"203.0.113.9") == "127.0.0.1"  # none trusted by default
    with pytest.raises(ConfigError, match=r"--forwarded_allow_ips: 'proxy.local' is not an address"):
        ClientShares(1, 1, forwarded_allow_ips="proxy.local")


def test_a_slot_given_back_admits_the_newest_waiting_connection_that_fits() -> None:
    """Connections holding a refusal wait in line (ClientShares.wait_for_room): as a request ends, the newest that
    fits is admitted, one per slot; one that does not fit goes to the back, one held past its budget leaves."""
    from vlfit.serve.clients import ClientShares

    class Waiting:
        def __init__(self, fits: bool | None) -> None:
            self.fits, self.tried = fits, 0

        def try_admit(self) -> bool | None:
            self.tried += 1
            return self.fits

    shares = ClientShares(max_connections=4, max_requests=1, max_uploads=1)
    assert shares.start_request("a") and shares.in_flight == 1 and not shares.start_request("a")
    assert shares.start_upload("b") and not shares.start_upload("b")
    assert shares.over_share("b", uploading=True) == ("client_uploads", shares.uploads_refusal)
    old, new, expired, stuck = Waiting(True), Waiting(True), Waiting(None), Waiting(False)
    for waiter in (old, new, expired, stuck):
        shares.wait_for_room(waiter)
    shares.end_request("a")  # one slot: stuck (to the back), expired (leaves), then new is admitted
    assert shares.in_flight == 0 and (stuck.tried, expired.tried, new.tried, old.tried) == (1, 1, 1, 0)
    shares.end_upload("b")  # old is the newest of those left
    assert old.tried == 1 and stuck.tried == 1 and shares.uploads["b"] == 0
    shares.stop_waiting(stuck)
    shares.end_request("c")
    assert stuck.tried == 1


def test_tls_handshakes_time_out_and_count_against_max_connections(served_index, tmp_path) -> None:
    """Plain TCP connections to the HTTPS port that never start a handshake: those beyond the client's share
    (--max_connections_per_client) or --max_connections are closed at once, the others after --header_timeout; an
    HTTPS client is answered once they are gone."""
    from vlfit.serve.launch import kill_process_tree, start_server

    cap, share = 6, 4
    flags = ["--index", str(served_index), "--reload_interval", "0", "--max_connections", str(cap),
             "--max_connections_per_client", str(share), "--header_timeout", str(HEADER_TIMEOUT),
             "--ssl_certfile", str(DATA / "loopback-cert.pem"),
             "--ssl_keyfile", str(DATA / "loopback-key.pem")]  # fmt: skip
    log = tmp_path / "server.log"
    server = start_server(flags, str(log), timeout=START_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        assert server.url.startswith("https://") and "Uvicorn running on https://" in log.read_text()
        client = ssl.create_default_context(cafile=str(DATA / "loopback-cert.pem"))
        assert httpx.get(f"{server.url}/api/health", verify=client, timeout=TIMEOUT).status_code == 200
        hog = [_connect(server.port, "127.0.0.2") for _ in range(share + 2)]  # 2 beyond its share
        other = [_connect(server.port, "127.0.0.3") for _ in range(cap - share + 2)]  # 2 beyond the server's cap
        started = time.monotonic()
        try:
            for connection in hog + other:
                connection.settimeout(HEADER_TIMEOUT + 10)
            beyond_share = [c for c in hog[share:] if _closed_within(c, HEADER_TIMEOUT / 2)]
            assert len(beyond_share) == 2, "handshakes beyond --max_connections_per_client were left open"
            beyond_cap = [c for c in other[cap - share :] if _closed_within(c, HEADER_TIMEOUT / 2)]
            assert len(beyond_cap) == 2, "handshakes beyond --max_connections were left open"
            for connection in hog + other:
                assert _closed_within(connection, HEADER_TIMEOUT + 10)
            assert time.monotonic() - started < HEADER_TIMEOUT + 10
        finally:
            for connection in hog + other:
                connection.close()
        assert httpx.get(f"{server.url}/api/health", verify=client, timeout=TIMEOUT).status_code == 200
        assert _refused(server.url, client, "connections") >= 2
        assert _refused(server.url, client, "client_connections") >= 2
    finally:
        kill_process_tree(server.process)


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    connection.settimeout(seconds)
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _refused(base: str, context: ssl.SSLContext, limit: str) -> float:
    text = httpx.get(f"{base}/metrics", verify=context, timeout=TIMEOUT).text
    found = re.search(rf'^vlfit_refused_total\{{limit="{limit}"\}} (\S+)$', text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def test_refusals_held_for_their_retry_after_are_bounded() -> None:
    """Beyond max_held connections waiting for their 429, the next is not held (closed at once)."""
    from vlfit.serve.clients import ClientShares

    shares = ClientShares(max_connections=1, max_requests=1, max_held=3)
    assert all(shares.hold_refusal() for _ in range(3))
    assert not shares.hold_refusal()
    shares.release_refusal()
    assert shares.hold_refusal()


def test_held_refusals_get_descriptors_beside_the_connections() -> None:
    """With the common soft limit of 1024 descriptors, the server raises it towards what --max_connections and the
    held refusals need (as far as the hard limit goes), and holds no more refusals than then fit."""
    import resource

    from vlfit.serve.clients import DESCRIPTOR_MARGIN, HELD_REFUSALS, held_refusals_that_fit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        low = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        held = held_refusals_that_fit(512)
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised == min(hard, 512 + HELD_REFUSALS + DESCRIPTOR_MARGIN) or hard == resource.RLIM_INFINITY
        assert 512 + held + DESCRIPTOR_MARGIN <= raised or raised == resource.RLIM_INFINITY
        assert held == min(HELD_REFUSALS, raised - 512 - DESCRIPTOR_MARGIN)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
