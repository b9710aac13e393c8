"""The load clients of ``benchmarks/serve_pressure.py`` (a module of it, not a script of its own).

Each sends to a base URL: ``vlfit serve``'s own (``http(s)://127.0.0.1:PORT``) or the nginx front's
(``https://127.0.0.1:PORT``), over TLS when it is HTTPS, so the same level runs against either. They connect and read
answers with the nginx test's own client (``tests/serve/nginx.py``: ``connect``, ``read_answer``), on asyncio
streams, which cost the shared cores far less than a full HTTP client library would. Every client has a loopback
source address of its own (Linux routes all of 127/8 to lo), as clients on a network would, so the server's (and the
front's) per-address limits see them as the distinct clients they are.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.serve.nginx: nginx and its clients
from tests.serve import nginx as front  # noqa: E402

ANSWER_TIMEOUT_S = 30.0
# An answer that never came whole: the connection reset or closed under it (TLS errors are OSErrors), or no answer.
BROKEN = (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError)
UNLOADED_QUERIES = 200
UNLOADED_EACH = 10  # one after another from each address: within the front's burst, so its rate limit never answers
SLOW_BYTE_EVERY_S = 1.0


def ms(seconds: list[float], q: float) -> float | None:
    """The ``q`` percentile of ``seconds`` in milliseconds; None for none."""
    return round(float(np.percentile(1000 * np.array(seconds), q)), 2) if seconds else None


async def exchange(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> front.Answer:
    """Send one request on an open connection and read its answer."""
    reader, writer = connection
    writer.write(request)
    return await front.read_answer(reader, ANSWER_TIMEOUT_S)


async def querying_client(base: str, address: str, requests: list[bytes], until: float, *, answered: list[float],
                          counts: Counter, stop_after: int | None = None, pause: float = 0.0) -> None:  # fmt: skip
    """Send queries from ``address`` on a kept-open connection until ``until`` (loop time), each ``pause`` seconds
    after the last is answered, refused or broken (then on a new connection); answered ones' times (from their
    send) go to ``answered``, every outcome to ``counts``. A connection the server closed while it was idle (a front
    reclaims idle ones) is opened again before the next query, as an HTTP client library does."""
    loop, connection, sent = asyncio.get_running_loop(), None, 0
    while loop.time() < until and (stop_after is None or sent < stop_after):
        if connection is not None and connection[0].at_eof():
            connection[1].close()
            connection, counts["reopened_idle"] = None, counts["reopened_idle"] + 1
        if connection is None:
            try:
                connection = await front.connect(base, address)
            except (OSError, asyncio.TimeoutError):
                counts["connect_failed"] += 1
                await asyncio.sleep(0.001)
                continue
        request, started = requests[sent % len(requests)], time.perf_counter()
        sent += 1
        try:
            answer = await exchange(connection, request)
        except BROKEN:
            counts["broken"] += 1
            connection[1].close()
            connection = None
            continue
        counts[answer.status] += 1
        if answer.status == 200:
            answered.append(time.perf_counter() - started)
        if answer.closes:
            connection[1].close()
            connection = None
        if pause:
            await asyncio.sleep(pause)
    if connection is not None:
        connection[1].close()


async def closed_loop(base: str, requests: list[bytes], clients: int, seconds: float, *, first: int = 1,
                      address: str | None = None, pause: float = 0.0) -> dict:  # fmt: skip
    """``clients`` querying clients for ``seconds``, each from an address of its own (``127.0.1.first`` on), or all
    from ``address``; figures of the answered queries and every outcome."""
    loop = asyncio.get_running_loop()
    answered: list[float] = []
    counts: Counter = Counter()
    started = loop.time()
    await asyncio.gather(*(querying_client(base, address or f"127.0.1.{first + i}", requests, started + seconds,
                                           answered=answered, counts=counts, pause=pause)
                           for i in range(clients)))  # fmt: skip
    wall = loop.time() - started
    tries = sum(counts.values()) - counts["reopened_idle"]  # a connection reopened before a query is no try
    return {"clients": clients, "seconds": round(wall, 2), "answered_qps": round(counts[200] / wall, 1),
            "p50_ms": ms(answered, 50), "p99_ms": ms(answered, 99), "tries": tries,
            "outcomes": {str(k): v for k, v in sorted(counts.items(), key=str)}}  # fmt: skip


async def unloaded(base: str, requests: list[bytes]) -> dict:
    """One client alone: ``UNLOADED_QUERIES`` queries one after another, ``UNLOADED_EACH`` from each of a run of
    addresses in turn."""
    answered: list[float] = []
    counts: Counter = Counter()
    addresses = UNLOADED_QUERIES // UNLOADED_EACH
    for n in range(addresses):
        await querying_client(base, f"127.0.1.{230 + n}", requests, float("inf"), answered=answered, counts=counts,
                              stop_after=UNLOADED_EACH)  # fmt: skip
    return {"queries": UNLOADED_QUERIES, "addresses": addresses, "p50_ms": ms(answered, 50), "answered": counts[200]}


async def hold(base: str, address: str, stop: asyncio.Event, closed: Counter, *, tls_idle: bool = False) -> None:
    """One connection slot held from ``address``: a plain TCP connection that sends nothing (to an HTTPS server, a
    handshake never started), opened again once the server closes it. ``tls_idle``: not opened again, and when
    the server closed it recorded."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not stop.is_set():
        try:
            reader, writer = await front.connect(base, address, tls=False)
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


async def trickle(base: str, address: str, stop: asyncio.Event, outcomes: Counter) -> None:
    """One search from ``address`` whose body comes a byte every ``SLOW_BYTE_EVERY_S`` seconds after its head, sent
    again on a new connection as soon as the server answers it or closes the connection."""
    request = front.search_request("a query whose body arrives slowly " * 8, k=10)
    start = request.index(b"\r\n\r\n") + 4
    while not stop.is_set():
        try:
            reader, writer = await front.connect(base, address)
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


def crowd_process(base: str, kind: str, shape: tuple[int, int], seconds: float, results) -> None:
    """The crowd, in a process of its own (clients on other machines: their reconnecting is not in the event loop
    that times the querying clients), for ``seconds``: ``kind`` "hog", ``shape`` (addresses, idle connections
    each) held and reopened, or "slow", ``shape`` (addresses, requests in all) sending their bodies slowly. What it
    saw goes to ``results``."""

    async def crowd() -> None:
        stop, counts = asyncio.Event(), Counter()
        addresses, each = shape
        loop = asyncio.get_running_loop()
        if kind == "hog":
            tasks = [loop.create_task(hold(base, f"127.0.2.{1 + a}", stop, counts))
                     for a in range(addresses) for _ in range(each)]  # fmt: skip
        else:
            tasks = [loop.create_task(trickle(base, f"127.0.3.{1 + n % addresses}", stop, counts))
                     for n in range(each)]  # fmt: skip
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        results.put(dict(counts))

    asyncio.run(crowd())
