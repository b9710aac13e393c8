"""``vlfit serve`` under pressure: goodput when more clients resend than it admits, addresses holding every
connection slot, request bodies that trickle in, and idle connections to an HTTPS server that never start their
handshake.

Each level runs against a real ``vlfit serve`` process on a free loopback port, started with the soft limit of
1024 file descriptors most Linux machines give a process (the load client keeps its own, higher one). Every client
has a loopback source address of its own (``127.0.1.N``, Linux routes all of 127/8 to lo), as clients on a network
would, so the server's per-address limits see them as the distinct clients they are.

1. **Closed loop, resend at once** (``RESEND_LEVELS``: 8, 32, 64 and 128 clients, ``RESEND_S`` seconds each): each
   client keeps one keep-alive connection and sends a text query as soon as its last one is answered, refused
   (503, 429) or its connection broken (then it connects again). Figures: answered queries/s, p50/p99 of the
   answered ones (from their send), refusals by status, broken connections. Goal: at 128 clients answered/s >= 80%
   of the best level's and p99 <= 10x the unloaded p50 (one client alone, ``UNLOADED_QUERIES`` queries).
2. **Addresses hold the connections** (``HOG_SHAPES``: 9 addresses x 60 and 40 x 15 idle connections, more than
   the default 512 slots, each within the 64 per address): ``HOG_CLIENTS`` clients of a tenth address query one
   after another on kept-open connections (``CROWD_S`` seconds), quiet and then while the addresses hold their
   connections, sending nothing and opening another as soon as one is closed (in a process of their own). Figures:
   the tenth address's fraction of tries answered and its p50, quiet and crowded, and what the crowd saw. Goal:
   >= 95% answered and a p50 within 2x of the quiet one.
3. **Slow bodies** (``SLOW_SHAPES``: 32 and 64 requests from 2 addresses sending their bodies a byte every
   ``SLOW_BYTE_EVERY_S`` seconds, each sent again when answered or closed): ``HOG_CLIENTS`` clients of another
   address query meanwhile. Figures as in 2., and the slow requests' outcomes. Goal: >= 95% answered.
4. **Idle TLS handshakes** (a second server, with ``--ssl_certfile``): ``TLS_IDLE_CONNECTIONS`` plain TCP
   connections from one address that never start a handshake, then an HTTPS health check every
   ``TLS_TRY_EVERY_S`` seconds from another address for ``TLS_S`` seconds. Figures: tries answered, and how many of
   the idle connections the server had closed by the end, and when the last one went.

    python benchmarks/serve_pressure.py --index DIR --model DIR [--server_src DIR] [--seconds S] [--server_flags ...]

``benchmarks/serve_load.py`` runs it as its last part (on its INT8 model and 10^5-vector index); alone, it takes an
index and model already built. ``--server_src`` runs the server from another checkout's ``src`` (PYTHONPATH), so
two versions meet the same load from the same client; ``--seconds`` sets how long each level and each crowd
measures (a short smoke run: 2). About 3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import ssl
import sys
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np

RESEND_LEVELS = (8, 32, 64, 128)
RESEND_S = 8.0
WARM_UP_S = 3.0
UNLOADED_QUERIES = 200
HOG_SHAPES = ((9, 60), (40, 15))  # addresses x idle connections each: 540 and 600, over the default 512
HOG_CLIENTS = 8  # the querying clients of the tenth address (or, beside slow bodies, of another one)
CROWD_S = 8.0  # seconds each crowded run (and the quiet one before) measures
CROWD_SETTLE_S = 3.0  # the crowd starts this long before the measure, to hold what it can
SLOW_SHAPES = (32, 64)  # requests sending their bodies slowly, from 2 addresses
SLOW_BYTE_EVERY_S = 1.0
TLS_IDLE_CONNECTIONS = 1100  # past the server's 1024 descriptors
TLS_S = 15.0
TLS_TRY_EVERY_S = 0.5
SERVER_NOFILE = 1024
ANSWER_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # a connection the server never accepts (its backlog full) counts as failed
LEVELS = ("resend", "hog", "slow", "tls")
CERT_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "serve", "data")


def _request(text: str) -> bytes:
    body = json.dumps({"text": text, "k": 10}).encode()
    head = "POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bool]:
    """Send one request on a keep-alive connection, read its answer: its status and whether the server closes."""
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_TIMEOUT_S)
    fields = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:]
                                                        if b":" in line)}  # fmt: skip
    await asyncio.wait_for(reader.readexactly(int(fields.get(b"content-length", b"0"))), ANSWER_TIMEOUT_S)
    return int(head.split(b" ", 2)[1]), fields.get(b"connection", b"").lower() == b"close"


def _ms(seconds: list[float], q: float) -> float | None:
    return round(float(np.percentile(1000 * np.array(seconds), q)), 2) if seconds else None


async def _querying_client(port: int, address: str, requests: list[bytes], until: float, *,
                           answered: list[float], counts: Counter, stop_after: int | None = None) -> None:  # fmt: skip
    """Send queries one after another until ``until`` (loop time), each as soon as the last is answered, refused
    or broken; answered ones' times go to ``answered``, every outcome to ``counts``."""
    loop, connection, sent = asyncio.get_running_loop(), None, 0
    while loop.time() < until and (stop_after is None or sent < stop_after):
        if connection is None:
            try:
                connection = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0)), CONNECT_TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError):
                counts["connect_failed"] += 1
                await asyncio.sleep(0.001)
                continue
        request, started = requests[sent % len(requests)], time.perf_counter()
        sent += 1
        try:
            status, close = await _exchange(*connection, request)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError):
            counts["broken"] += 1
            connection[1].close()
            connection = None
            continue
        counts[status] += 1
        if status == 200:
            answered.append(time.perf_counter() - started)
        if close:
            connection[1].close()
            connection = None
    if connection is not None:
        connection[1].close()


async def _closed_loop(port: int, requests: list[bytes], clients: int, seconds: float, first: int = 1,
                       address: str | None = None) -> dict:  # fmt: skip
    """``clients`` querying clients for ``seconds``, each from an address of its own (``127.0.1.first`` on), or all
    from ``address``."""
    loop = asyncio.get_running_loop()
    answered: list[float] = []
    counts: Counter = Counter()
    started = loop.time()
    await asyncio.gather(*(_querying_client(port, address or f"127.0.1.{first + i}", requests, started + seconds,
                                            answered=answered, counts=counts) for i in range(clients)))  # fmt: skip
    wall = loop.time() - started
    return {"clients": clients, "seconds": round(wall, 2), "answered_qps": round(counts[200] / wall, 1),
            "p50_ms": _ms(answered, 50), "p99_ms": _ms(answered, 99), "tries": sum(counts.values()),
            "outcomes": {str(k): v for k, v in sorted(counts.items(), key=str)}}  # fmt: skip


async def _unloaded(port: int, requests: list[bytes]) -> dict:
    answered: list[float] = []
    counts: Counter = Counter()
    await _querying_client(port, "127.0.1.250", requests, float("inf"), answered=answered, counts=counts,
                           stop_after=UNLOADED_QUERIES)  # fmt: skip
    return {"queries": UNLOADED_QUERIES, "p50_ms": _ms(answered, 50), "answered": counts[200]}


async def _hold(port: int, address: str, stop: asyncio.Event, closed: Counter, *, tls_idle: bool = False) -> None:
    """One connection slot held from ``address``: connect, send nothing, and connect again once the server closes
    it (a plain TCP connection; to an HTTPS server it is a handshake never started). ``tls_idle``: do not connect
    again, and record when the server closed it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0)), CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError):
            closed["connect_failed"] += 1
            await asyncio.sleep(0.01)
            continue
        waiting = loop.create_task(reader.read(1 << 16))
        stopping = loop.create_task(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        writer.close()
        if waiting.done():
            closed["closed_by_server"] += 1
            if tls_idle:
                closed["last_closed_ms"] = max(closed["last_closed_ms"], int(1000 * (loop.time() - started)))
                return
        else:
            waiting.cancel()


async def _trickle(port: int, address: str, stop: asyncio.Event, outcomes: Counter) -> None:
    """One request from ``address`` whose body comes a byte every ``SLOW_BYTE_EVERY_S`` seconds after its head,
    sent again on a new connection as soon as the server answers it or closes the connection."""
    request = _request("a query whose body arrives slowly " * 8)
    start = request.index(b"\r\n\r\n") + 4
    while not stop.is_set():
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0)), CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError):
            outcomes["connect_failed"] += 1
            await asyncio.sleep(0.01)
            continue
        sent = start + 1
        try:
            writer.write(request[:sent])
            while not stop.is_set() and sent < len(request):
                try:
                    answer = await asyncio.wait_for(reader.read(1 << 16), SLOW_BYTE_EVERY_S)
                except asyncio.TimeoutError:
                    writer.write(request[sent : sent + 1])
                    sent += 1
                    continue
                outcomes[answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"] += 1
                break
        except OSError:
            outcomes["broken"] += 1
        writer.close()


def _crowd_process(port: int, kind: str, shape: tuple[int, int], seconds: float, results) -> None:
    """The crowd, in a process of its own (clients on other machines: their reconnecting is not in the event loop
    that times the querying clients), for ``seconds``: ``kind`` "hog", ``shape`` (addresses, idle connections
    each) held and reopened, or "slow", ``shape`` (addresses, requests in all) sending their bodies slowly. What it
    saw goes to ``results``."""

    async def crowd() -> None:
        stop, counts = asyncio.Event(), Counter()
        addresses, each = shape
        loop = asyncio.get_running_loop()
        if kind == "hog":
            tasks = [loop.create_task(_hold(port, f"127.0.2.{1 + a}", stop, counts))
                     for a in range(addresses) for _ in range(each)]  # fmt: skip
        else:
            tasks = [loop.create_task(_trickle(port, f"127.0.3.{1 + n % addresses}", stop, counts))
                     for n in range(each)]  # fmt: skip
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        results.put(dict(counts))

    asyncio.run(crowd())


async def _crowded(port: int, requests: list[bytes], kind: str, seconds: float) -> list[dict]:
    """A tenth address's ``HOG_CLIENTS`` clients for ``seconds``, quiet and then beside each crowd of ``kind``
    (``HOG_SHAPES`` or ``SLOW_SHAPES``)."""
    import multiprocessing

    address = "127.0.1.100"
    quiet = await _closed_loop(port, requests, HOG_CLIENTS, seconds, address=address)
    context = multiprocessing.get_context("spawn")
    shapes = HOG_SHAPES if kind == "hog" else tuple((2, n) for n in SLOW_SHAPES)
    runs = []
    for shape in shapes:
        results = context.Queue()
        crowd = context.Process(target=_crowd_process, args=(port, kind, shape, seconds + CROWD_SETTLE_S + 1, results))
        crowd.start()
        await asyncio.sleep(CROWD_SETTLE_S)  # the crowd started and holds what it can
        crowded = await _closed_loop(port, requests, HOG_CLIENTS, seconds, address=address)
        seen = await asyncio.get_running_loop().run_in_executor(None, results.get, True, 60)
        crowd.join(60)
        await asyncio.sleep(1.0)  # the crowd's connections are closed before the next
        runs.append({"addresses": shape[0], ("connections_each" if kind == "hog" else "slow_requests"): shape[1],
                     "answered_fraction": round(crowded["outcomes"].get("200", 0) / max(1, crowded["tries"]), 3),
                     "quiet_answered_fraction": round(quiet["outcomes"].get("200", 0) / max(1, quiet["tries"]), 3),
                     "p50_ratio": round(crowded["p50_ms"] / quiet["p50_ms"], 2) if crowded["p50_ms"] else None,
                     "quiet": quiet, "crowded": crowded, "crowd_saw": seen})  # fmt: skip
        print(json.dumps({kind: runs[-1]}), flush=True)
    return runs


async def _tls_idle(port: int, seconds: float) -> dict:
    context = ssl.create_default_context(cafile=os.path.join(CERT_DIR, "loopback-cert.pem"))
    stop, closed = asyncio.Event(), Counter()
    loop = asyncio.get_running_loop()
    idle = [loop.create_task(_hold(port, "127.0.0.3", stop, closed, tls_idle=True))
            for _ in range(TLS_IDLE_CONNECTIONS)]  # fmt: skip
    await asyncio.sleep(1.0)
    tries, answered, failures = 0, 0, Counter()
    until = loop.time() + seconds
    while loop.time() < until:
        tries += 1
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=context, local_addr=("127.0.0.4", 0)), 5)  # fmt: skip
            status, _ = await _exchange(reader, writer, b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            writer.close()
            answered += status == 200
            if status != 200:
                failures[str(status)] += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ssl.SSLError) as error:
            failures[type(error).__name__] += 1
        await asyncio.sleep(TLS_TRY_EVERY_S)
    stop.set()
    await asyncio.gather(*idle)
    return {"idle_connections": TLS_IDLE_CONNECTIONS, "seconds": seconds, "https_tries": tries,
            "https_answered": answered, "https_failures": dict(failures),
            "idle_closed_by_server": closed["closed_by_server"],
            "last_idle_closed_after_s": round(closed["last_closed_ms"] / 1000, 1) if closed["closed_by_server"]
            else None}  # fmt: skip


@contextmanager
def _descriptors(limit: int):
    """The soft file-descriptor limit set to ``limit`` for what starts inside (a child inherits it), and put back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _start(flags: list[str], log_path: str, server_src: str | None):
    from vlfit.serve.launch import start_server

    env = {"PYTHONPATH": os.path.abspath(server_src)} if server_src else None
    with _descriptors(SERVER_NOFILE):
        return start_server(flags, log_path, timeout=180, env=env)


def _stop(server) -> int:
    server.process.send_signal(signal.SIGTERM)
    return server.process.wait(60)


def serve_pressure(index: str, model: str, out: str, server_flags: list[str] | None = None,
                   server_src: str | None = None, levels: tuple[str, ...] = LEVELS,
                   seconds: float | None = None) -> dict:  # fmt: skip
    """Run ``levels`` (of ``LEVELS``; ``server_flags`` given to both servers; each level measuring ``seconds``,
    else its own default) and return their figures."""
    from vlfit.data.synthetic.scenes import scene_and_choices

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the client's own connections: thousands
    rng = np.random.default_rng(3)
    requests = [_request(text) for _ in range(50) for text in scene_and_choices(rng)[1]]
    flags = ["--index", index, "--model", model, "--reload_interval", "0", *(server_flags or [])]
    os.makedirs(out, exist_ok=True)
    server = _start(flags, os.path.join(out, "pressure-server.log"), server_src)
    try:
        asyncio.run(_closed_loop(server.port, requests, 8, WARM_UP_S))  # first allocations, caches: not measured
        unloaded = asyncio.run(_unloaded(server.port, requests))
        resend, crowded, tls = [], {}, None
        for clients in RESEND_LEVELS if "resend" in levels else ():
            resend.append(asyncio.run(_closed_loop(server.port, requests, clients, seconds or RESEND_S)))
            print(json.dumps({"resend": resend[-1]}), flush=True)
        for kind in ("hog", "slow"):
            if kind in levels:
                crowded[kind] = asyncio.run(_crowded(server.port, requests, kind, seconds or CROWD_S))
    finally:
        _stop(server)
    best = max((level["answered_qps"] for level in resend), default=0)
    for level in resend:
        level["of_best"] = round(level["answered_qps"] / best, 3) if best else None
        level["p99_over_unloaded_p50"] = round(level["p99_ms"] / unloaded["p50_ms"], 1) if level["p99_ms"] else None
    if "tls" in levels:
        cert, key = (os.path.join(CERT_DIR, name) for name in ("loopback-cert.pem", "loopback-key.pem"))
        tls_server = _start([*flags, "--ssl_certfile", cert, "--ssl_keyfile", key],
                            os.path.join(out, "pressure-tls-server.log"), server_src)  # fmt: skip
        try:
            tls = asyncio.run(_tls_idle(tls_server.port, seconds or TLS_S))
            print(json.dumps({"tls_idle": tls}), flush=True)
        finally:
            _stop(tls_server)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"server_src": server_src, "server_flags": server_flags or [], "server_nofile": SERVER_NOFILE,
            "unloaded": unloaded, "resend": resend, "hog": crowded.get("hog"), "slow": crowded.get("slow"),
            "tls_idle": tls}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", required=True, help="An index folder (serve_load.py writes one of 10^5 vectors).")
    parser.add_argument("--model", required=True, help="The model or export the server embeds queries with.")
    parser.add_argument("--out", default="runs/serve-pressure")
    parser.add_argument("--server_src", default=None, help="Run the server from this src folder (PYTHONPATH).")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS), help="The levels to run.")
    parser.add_argument("--seconds", type=float, default=None, help="How long each level measures (a smoke run: 2).")
    parser.add_argument("--server_flags", nargs=argparse.REMAINDER, default=[],
                        help="Flags of vlfit serve (last: everything after it is passed on).")  # fmt: skip
    args = parser.parse_args()
    results = {"load_average": os.getloadavg(), **serve_pressure(args.index, args.model, args.out,
                                                                 args.server_flags, args.server_src,
                                                                 tuple(args.levels), args.seconds)}  # fmt: skip
    with open(os.path.join(args.out, "serve_pressure.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
