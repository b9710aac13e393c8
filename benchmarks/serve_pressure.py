"""``vlfit serve`` under pressure: goodput when more clients resend than it admits, one address hogging the
connection slots, and idle connections to an HTTPS server that never start their handshake.

Each level runs against a real ``vlfit serve`` process on a free loopback port, started with the soft limit of
1024 file descriptors most Linux machines give a process (the load client keeps its own, higher one). Every client
has a loopback source address of its own (``127.0.1.N``, Linux routes all of 127/8 to lo), as clients on a network
would, so the server's per-address limits see them as the distinct clients they are.

1. **Closed loop, resend at once** (``RESEND_LEVELS``: 8, 32, 64 and 128 clients, ``RESEND_S`` seconds each): each
   client keeps one keep-alive connection and sends a text query as soon as its last one is answered, refused
   (503, 429) or its connection broken (then it connects again). Figures: answered queries/s, p50/p99 of the
   answered ones (from their send), refusals by status, broken connections. Goal: at 128 clients answered/s >= 80%
   of the best level's and p99 <= 10x the unloaded p50 (one client alone, ``UNLOADED_QUERIES`` queries).
2. **One address hogs the connections**: 8 clients query one after another (``HOG_S`` seconds), quiet and then
   while one address (``127.0.0.2``) holds ``HOG_CONNECTIONS`` connections that send nothing and opens another as
   soon as one is closed. Figures: the 8 clients' fraction of tries answered and their p50, quiet and hogged.
   Goal: a fraction near 1 and a p50 within 2x of the quiet one.
3. **Idle TLS handshakes** (a second server, with ``--ssl_certfile``): ``TLS_IDLE_CONNECTIONS`` plain TCP
   connections from one address that never start a handshake, then an HTTPS health check every
   ``TLS_TRY_EVERY_S`` seconds from another address for ``TLS_S`` seconds. Figures: tries answered, and how many of
   the idle connections the server had closed by the end, and when the last one went.

    python benchmarks/serve_pressure.py --index DIR --model DIR [--server_src DIR] [--server_flags ...]

``benchmarks/serve_load.py`` runs it as its last part (on its INT8 model and 10^5-vector index); alone, it takes an
index and model already built. ``--server_src`` runs the server from another checkout's ``src`` (PYTHONPATH), so
two versions meet the same load from the same client. About 90 s.
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
HOG_CONNECTIONS = 520
HOG_CLIENTS = 8
HOG_S = 8.0
TLS_IDLE_CONNECTIONS = 1100  # past the server's 1024 descriptors
TLS_S = 15.0
TLS_TRY_EVERY_S = 0.5
SERVER_NOFILE = 1024
ANSWER_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # a connection the server never accepts (its backlog full) counts as failed
LEVELS = ("resend", "hog", "tls")
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


async def _closed_loop(port: int, requests: list[bytes], clients: int, seconds: float, first: int = 1) -> dict:
    loop = asyncio.get_running_loop()
    answered: list[float] = []
    counts: Counter = Counter()
    started = loop.time()
    await asyncio.gather(*(_querying_client(port, f"127.0.1.{first + i}", requests, started + seconds,
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


def _hog_process(port: int, seconds: float, closed_by_server) -> None:
    """The hog, in a process of its own (a client on another machine: its reconnecting is not in this process's
    event loop, which times the other clients): ``HOG_CONNECTIONS`` held slots for ``seconds``."""

    async def hold_all() -> None:
        stop, closed = asyncio.Event(), Counter()
        holders = [asyncio.get_running_loop().create_task(_hold(port, "127.0.0.2", stop, closed))
                   for _ in range(HOG_CONNECTIONS)]  # fmt: skip
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*holders)
        closed_by_server.value = closed["closed_by_server"]

    asyncio.run(hold_all())


async def _hog(port: int, requests: list[bytes]) -> dict:
    import multiprocessing

    quiet = await _closed_loop(port, requests, HOG_CLIENTS, HOG_S, first=100)
    context = multiprocessing.get_context("spawn")
    closed = context.Value("q", 0)
    hog = context.Process(target=_hog_process, args=(port, HOG_S + 4.0, closed))
    hog.start()
    await asyncio.sleep(3.0)  # the hog started and holds what it can
    hogged = await _closed_loop(port, requests, HOG_CLIENTS, HOG_S, first=100)
    hog.join(60)

    def answered(run: dict) -> float:
        return round(run["outcomes"].get("200", 0) / max(1, run["tries"]), 3)

    return {"hog_connections": HOG_CONNECTIONS, "quiet": quiet, "hogged": hogged,
            "answered_fraction": {"quiet": answered(quiet), "hogged": answered(hogged)},
            "p50_ratio": round(hogged["p50_ms"] / quiet["p50_ms"], 2) if hogged["p50_ms"] else None,
            "hog_connections_closed_by_server": closed.value}  # fmt: skip


async def _tls_idle(port: int) -> dict:
    context = ssl.create_default_context(cafile=os.path.join(CERT_DIR, "loopback-cert.pem"))
    stop, closed = asyncio.Event(), Counter()
    loop = asyncio.get_running_loop()
    idle = [loop.create_task(_hold(port, "127.0.0.3", stop, closed, tls_idle=True))
            for _ in range(TLS_IDLE_CONNECTIONS)]  # fmt: skip
    await asyncio.sleep(1.0)
    tries, answered, failures = 0, 0, Counter()
    until = loop.time() + TLS_S
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
    return {"idle_connections": TLS_IDLE_CONNECTIONS, "seconds": TLS_S, "https_tries": tries,
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
                   server_src: str | None = None, levels: tuple[str, ...] = LEVELS) -> dict:  # fmt: skip
    """Run ``levels`` (of ``LEVELS``; ``server_flags`` given to both servers) and return their figures."""
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
        resend, hog, tls = [], None, None
        for clients in RESEND_LEVELS if "resend" in levels else ():
            resend.append(asyncio.run(_closed_loop(server.port, requests, clients, RESEND_S)))
            print(json.dumps({"resend": resend[-1]}), flush=True)
        if "hog" in levels:
            hog = asyncio.run(_hog(server.port, requests))
            print(json.dumps({"hog": hog}), flush=True)
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
            tls = asyncio.run(_tls_idle(tls_server.port))
            print(json.dumps({"tls_idle": tls}), flush=True)
        finally:
            _stop(tls_server)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"server_src": server_src, "server_flags": server_flags or [], "server_nofile": SERVER_NOFILE,
            "unloaded": unloaded, "resend": resend, "hog": hog, "tls_idle": tls}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", required=True, help="An index folder (serve_load.py writes one of 10^5 vectors).")
    parser.add_argument("--model", required=True, help="The model or export the server embeds queries with.")
    parser.add_argument("--out", default="runs/serve-pressure")
    parser.add_argument("--server_src", default=None, help="Run the server from this src folder (PYTHONPATH).")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS), help="The levels to run.")
    parser.add_argument("--server_flags", nargs=argparse.REMAINDER, default=[],
                        help="Flags of vlfit serve (last: everything after it is passed on).")  # fmt: skip
    args = parser.parse_args()
    results = {"load_average": os.getloadavg(), **serve_pressure(args.index, args.model, args.out,
                                                                 args.server_flags, args.server_src,
                                                                 tuple(args.levels))}  # fmt: skip
    with open(os.path.join(args.out, "serve_pressure.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
