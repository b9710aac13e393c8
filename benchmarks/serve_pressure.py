"""``vlfit serve`` under pressure, each case against the server's defaults and then (``--front nginx``) through the
nginx front of ``deploy/nginx/``: more clients resending than it admits, open-loop arrivals at twice the capacity
measured in the same run, addresses holding every connection slot, request bodies that trickle in, one address over
the front's request rate, idle connections to an HTTPS port that never start their handshake, and ``--workers 2``
from its ready line.

Each level runs against a real ``vlfit serve`` process on a free loopback port, started with the soft limit of
1024 file descriptors most Linux machines give a process (the load client keeps its own, higher one). Every client
has a loopback source address of its own (``127.0.1.N``, Linux routes all of 127/8 to lo), as clients on a network
would, so the server's per-address limits see them as the distinct clients they are. With ``--front nginx`` the
server gets ``--forwarded_allow_ips 127.0.0.1`` and Debian's nginx runs in front of it with ``deploy/nginx/vlfit.conf``
(started as ``tests/serve/nginx.py`` starts it, ``FRONT_WORKER_CONNECTIONS`` as Debian's nginx.conf, the same 1024
descriptors); every level but ``ready`` sends its load to the front's TLS port instead, with the same clients
(``pressure_clients.py``). Ratios are to the unloaded p50: one client alone, ``UNLOADED_QUERIES`` queries one after
another (10 from each of 20 addresses: within the front's burst).

1. ``resend``: closed loop, ``RESEND_LEVELS`` (8, 32, 64 and 128) clients for ``RESEND_S`` seconds each; each
   client keeps one keep-alive connection and sends a text query as soon as its last one is answered, refused
   (503, 429) or its connection broken (then it connects again). Figures: answered queries/s, p50/p99 of the
   answered ones (from their send), refusals by status, broken connections. Goal: at 128 clients answered/s >= 80%
   of the best level's and p99 <= 10x the unloaded p50.
2. ``overload``: open loop at ``OVERLOAD_TIMES`` (2x) the capacity, the best answered/s of the resend levels (when
   ``resend`` is not run, of closed loops at ``CAPACITY_LEVELS`` clients): queries arriving at fixed times whatever
   the answers, for ``OVERLOAD_S`` seconds, in two modes: ``pooled``, sent on ``OPEN_LOOP_CONNECTIONS`` kept-open
   connections, each from an address of its own (a balancer's way: an arrival waits for a free one), and
   ``fresh``, each arrival on a new connection from the next of as many addresses in turn, closed after its answer.
   Figures per mode: offered q/s and as a multiple of the capacity, admitted (200) count and p50/p99 from arrival,
   admitted p99 / unloaded p50, the other answers by status and their p50/p99 from arrival (how fast a refusal
   came), connections that failed; each mode is run ``OVERLOAD_RUNS`` (3) times and its run of median admitted p99
   reported, with every run's ratio. Goal: admitted p99 <= 10x the unloaded p50, the excess refused at once.
3. ``hog``: ``HOG_SHAPES`` (9 addresses x 60 and 40 x 15 idle connections, more than the default 512 slots, each
   within the 64 per address): ``HOG_CLIENTS`` clients of a tenth address query one after another on kept-open
   connections (``CROWD_S`` seconds), quiet and then while the addresses hold their connections, sending nothing and
   opening another as soon as one is closed (in a process of their own). Through the front the tenth address's
   clients pause ``HOG_CLIENTS`` x ``FRONT_PAUSE_S`` between queries (the address under the front's 10 searches a
   second). Figures: its fraction of tries answered and p50, quiet and crowded, and what the crowd saw. Goal: >= 95%
   answered and a p50 within 2x of the quiet one.
4. ``slow``: ``SLOW_SHAPES`` (32 and 64 requests from 2 addresses sending their bodies a byte a second, each sent
   again when answered or closed) while ``HOG_CLIENTS`` clients of another address query. Figures as in 3., and the
   slow requests' outcomes. Goal: >= 95% answered.
5. ``over_rate``: one address sends searches back to back on a kept-open connection for ``RATE_S`` seconds while
   another searches at a person's pace (``FRONT_PAUSE_S`` between). Figures: each one's answers by status, fraction
   answered, p50. The front answers the first's burst and then 10 a second and 429 the rest at once, the other's
   all; vlfit alone has no rate per address.
6. ``tls``: ``TLS_IDLE_CONNECTIONS`` plain TCP connections from one address that never start a handshake (direct:
   to a second server with ``--ssl_certfile``; through the front, to its own TLS port), then an HTTPS health check
   every ``TLS_TRY_EVERY_S`` seconds from another address for ``TLS_S`` seconds. Figures: tries answered, and how
   many of the idle connections the server had closed by the end, and when the last one went.
7. ``ready``: ``vlfit serve --workers 2 --port 0`` of its own (always direct: the line is vlfit's): from the
   moment its log has the ``Uvicorn running on`` line, a loopback connection every ``READY_TRY_EVERY_S`` seconds
   until ``READY_WATCH_S`` seconds after the first one accepted, ``/api/health`` every ``READY_HEALTH_EVERY`` tries.
   Figures: seconds to the line and to the first connection accepted, tries refused after the line (goal: 0), and
   what ``/api/health`` said of the workers.

    python benchmarks/serve_pressure.py --index DIR --model DIR [--front nginx] [--levels LEVEL ...]
        [--server_src DIR] [--seconds S] [--pin] [--server_flags ...]

``benchmarks/serve_load.py`` runs it as its last part (on its INT8 model and 10^5-vector index), and its own open
loop with ``open_loop``; alone, it takes an index and model already built. ``--server_src`` runs the server from
another checkout's ``src`` (PYTHONPATH), so two versions meet the same load from the same client; ``--seconds``
sets how long each level and each crowd measures (a short smoke run: 2); ``--pin`` puts the server (and its front)
on the first core and the load client on the others, so the client's own work is not in the server's latencies.
About 5 minutes each way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from pressure_clients import BROKEN, closed_loop, crowd_process, exchange, front, hold, ms, unloaded

RESEND_LEVELS = (8, 32, 64, 128)
RESEND_S = 8.0
CAPACITY_LEVELS = (64, 128)  # the capacity's closed loops when the resend levels are not run
WARM_UP_S = 3.0
OVERLOAD_TIMES = 2.0  # the open loop's arrivals, as a multiple of the capacity
OVERLOAD_S = 10.0
# Each open-loop mode is run this many times and its median run (by admitted p99) reported: with a fresh connection per
# arrival, the p99 of single runs of the same code ranged over 10.6-36.6x the unloaded p50 on a 2-core VM.
OVERLOAD_RUNS = 3
OPEN_LOOP_CONNECTIONS = 256  # pooled: the kept-open connections; fresh: the addresses taken in turn
OPEN_LOOP_MODES = ("pooled", "fresh")
REASON_CHARS = 60
HOG_SHAPES = ((9, 60), (40, 15))  # addresses x idle connections each: 540 and 600, over the default 512
# The querying clients of the tenth address (or, beside slow bodies, of another one): within one address's share of
# requests in flight (half of --max_concurrency, whose default is at least 8), so what refuses them is the crowd.
HOG_CLIENTS = 4
CROWD_S = 8.0  # seconds each crowded run (and the quiet one before) measures
CROWD_SETTLE_S = 3.0  # the crowd starts this long before the measure, to hold what it can
SLOW_SHAPES = (32, 64)  # requests sending their bodies slowly, from 2 addresses
RATE_S = 5.0
FRONT_PAUSE_S = 0.12  # between one address's searches: a person's pace, under the front's 10 a second
TLS_IDLE_CONNECTIONS = 1100  # past the server's 1024 descriptors
TLS_S = 15.0
TLS_TRY_EVERY_S = 0.5
READY_WORKERS = 2
READY_TRY_EVERY_S = 0.01
READY_WATCH_S = 5.0  # after the first connection accepted
READY_HEALTH_EVERY = 50
READY_TIMEOUT_S = 300.0
SERVER_NOFILE = 1024
FRONT_WORKER_CONNECTIONS = 768  # Debian's /etc/nginx/nginx.conf
LEVELS = ("resend", "overload", "hog", "slow", "over_rate", "tls", "ready")
HEALTH = b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _open_loop_address(number: int) -> str:
    return f"127.1.{number // 250}.{1 + number % 250}"


def _reason(answer: front.Answer) -> str:
    """A refusal's status and first words, numbers as N: which limit answered it."""
    return f"{answer.status} {re.sub(r'[0-9]+', 'N', answer.body.decode(errors='replace'))[:REASON_CHARS]}"


async def open_loop(base: str, requests: list[bytes], rate: float, seconds: float, mode: str = "pooled") -> dict:
    """Queries arriving every ``1 / rate`` seconds for ``seconds`` whatever the answers (open loop), sent to ``base``
    on a pool of ``OPEN_LOOP_CONNECTIONS`` kept-open connections (``mode`` "pooled"; an arrival waits for a free one,
    one the server closes is opened again at its next use) or each on a new connection, closed after its answer
    ("fresh"); every time from the query's arrival."""
    loop = asyncio.get_running_loop()
    admitted: list[float] = []
    refused: list[float] = []
    counts: Counter = Counter()
    reasons: Counter = Counter()
    pool: asyncio.Queue = asyncio.Queue()
    for number in range(OPEN_LOOP_CONNECTIONS if mode == "pooled" else 0):
        try:
            pool.put_nowait((number, await front.connect(base, _open_loop_address(number))))
        except (OSError, asyncio.TimeoutError):
            counts["connect_failed"] += 1
            pool.put_nowait((number, None))

    async def arrive(arrival: int, request: bytes, at: float) -> None:
        number, connection = await pool.get() if mode == "pooled" else (arrival % OPEN_LOOP_CONNECTIONS, None)
        if connection is not None and connection[0].at_eof():  # closed while idle: opened again, as a client does
            connection[1].close()
            connection, counts["reopened_idle"] = None, counts["reopened_idle"] + 1
        try:
            connection = connection or await front.connect(base, _open_loop_address(number))
        except (OSError, asyncio.TimeoutError):
            counts["connect_failed"] += 1
        else:
            try:
                answer = await exchange(connection, request)
                counts[answer.status] += 1
                (admitted if answer.status == 200 else refused).append(loop.time() - at)
                if answer.status != 200:
                    reasons[_reason(answer)] += 1
            except BROKEN:
                counts["broken"], answer = counts["broken"] + 1, None
            if answer is None or answer.closes or mode == "fresh":
                connection[1].close()
                connection = None
        if mode == "pooled":
            pool.put_nowait((number, connection))

    count, started, tasks = int(rate * seconds), loop.time(), []
    for arrival in range(count):
        at = started + arrival / rate
        if at > loop.time():
            await asyncio.sleep(at - loop.time())
        tasks.append(loop.create_task(arrive(arrival, requests[arrival % len(requests)], at)))
    sent_s = loop.time() - started
    await asyncio.gather(*tasks)
    wall = loop.time() - started
    while not pool.empty():
        _, connection = pool.get_nowait()
        if connection is not None:
            connection[1].close()
    return {"mode": mode, "offered_qps": round(rate, 1), "seconds": seconds, "arrivals": count,
            "arrivals_sent_in_s": round(sent_s, 2), "admitted": counts[200],
            "admitted_qps": round(counts[200] / wall, 1), "admitted_p50_ms": ms(admitted, 50),
            "admitted_p99_ms": ms(admitted, 99),
            "refused": {str(k): v for k, v in sorted(counts.items(), key=str) if isinstance(k, int) and k != 200},
            "refused_p50_ms": ms(refused, 50), "refused_p99_ms": ms(refused, 99),
            "refusal_reasons": dict(reasons.most_common(3)),
            "connections_failed": counts["connect_failed"] + counts["broken"],
            "connect_failed": counts["connect_failed"], "broken": counts["broken"],
            "reopened_idle": counts["reopened_idle"]}  # fmt: skip


def _ratio(figure: float | None, to: float | None, digits: int = 2) -> float | None:
    return round(figure / to, digits) if figure and to else None


def _overload(base: str, requests: list[bytes], capacity: float, unloaded_p50: float, seconds: float) -> list[dict]:
    """Each of ``OPEN_LOOP_MODES`` ``OVERLOAD_RUNS`` times; for each mode, its run of median admitted p99, with the
    ratio of every run (``p99_over_unloaded_p50_runs``)."""
    modes = []
    for mode in OPEN_LOOP_MODES:
        runs = []
        for _ in range(OVERLOAD_RUNS):
            run = asyncio.run(open_loop(base, requests, OVERLOAD_TIMES * capacity, seconds, mode))
            runs.append({**run, "capacity_qps": capacity, "of_capacity": _ratio(run["offered_qps"], capacity),
                         "unloaded_p50_ms": unloaded_p50,
                         "p99_over_unloaded_p50": _ratio(run["admitted_p99_ms"], unloaded_p50, 1)})  # fmt: skip
            print(json.dumps({"overload": runs[-1]}), flush=True)
            time.sleep(1.0)  # the last answers' connections closed before the next
        ranked = sorted(runs, key=lambda run: run["admitted_p99_ms"] or 0.0)
        modes.append({**ranked[len(ranked) // 2], "runs": len(runs),
                      "p99_over_unloaded_p50_runs": [run["p99_over_unloaded_p50"] for run in runs]})  # fmt: skip
    return modes


async def _crowded(base: str, requests: list[bytes], kind: str, seconds: float, pause: float) -> list[dict]:
    """A tenth address's ``HOG_CLIENTS`` clients for ``seconds`` (each ``pause`` seconds between its queries),
    quiet and then beside each crowd of ``kind`` (``HOG_SHAPES`` or ``SLOW_SHAPES``)."""
    import multiprocessing

    address = "127.0.1.100"
    quiet = await closed_loop(base, requests, HOG_CLIENTS, seconds, address=address, pause=pause)
    context = multiprocessing.get_context("spawn")
    shapes = HOG_SHAPES if kind == "hog" else tuple((2, n) for n in SLOW_SHAPES)
    runs = []
    for shape in shapes:
        results = context.Queue()
        crowd = context.Process(target=crowd_process, args=(base, kind, shape, seconds + CROWD_SETTLE_S + 1, results))
        crowd.start()
        await asyncio.sleep(CROWD_SETTLE_S)  # the crowd started and holds what it can
        crowded = await closed_loop(base, requests, HOG_CLIENTS, seconds, address=address, pause=pause)
        seen = await asyncio.get_running_loop().run_in_executor(None, results.get, True, 60)
        crowd.join(60)
        await asyncio.sleep(1.0)  # the crowd's connections are closed before the next
        runs.append({"addresses": shape[0], ("connections_each" if kind == "hog" else "slow_requests"): shape[1],
                     "answered_fraction": round(crowded["outcomes"].get("200", 0) / max(1, crowded["tries"]), 3),
                     "quiet_answered_fraction": round(quiet["outcomes"].get("200", 0) / max(1, quiet["tries"]), 3),
                     "p50_ratio": _ratio(crowded["p50_ms"], quiet["p50_ms"]),
                     "quiet": quiet, "crowded": crowded, "crowd_saw": seen})  # fmt: skip
        print(json.dumps({kind: runs[-1]}), flush=True)
    return runs


def _tally(tally: front.Tally) -> dict:
    return {"statuses": {str(k): v for k, v in sorted(tally.statuses.items(), key=str)},
            "answered": round(tally.answered(), 3), "p50_ms": ms(tally.seconds, 50)}  # fmt: skip


async def _over_rate(base: str, texts: list[str], seconds: float) -> dict:
    over, other = await asyncio.gather(front.back_to_back(base, "127.0.5.1", texts, seconds),
                                       front.queries(base, "127.0.5.2", texts, int(seconds / FRONT_PAUSE_S),
                                                     FRONT_PAUSE_S))  # fmt: skip
    return {"seconds": seconds, "over_rate": _tally(over), "other": _tally(other)}


async def _tls_idle(base: str, seconds: float) -> dict:
    stop, closed = asyncio.Event(), Counter()
    loop = asyncio.get_running_loop()
    idle = [loop.create_task(hold(base, "127.0.0.3", stop, closed, tls_idle=True))
            for _ in range(TLS_IDLE_CONNECTIONS)]  # fmt: skip
    await asyncio.sleep(1.0)
    tries, answered, failures = 0, 0, Counter()
    until = loop.time() + seconds
    while loop.time() < until:
        tries += 1
        try:
            connection = await front.connect(base, "127.0.0.4")
            status = (await exchange(connection, HEALTH)).status
            connection[1].close()
            answered += status == 200
            if status != 200:
                failures[str(status)] += 1
        except BROKEN as error:
            failures[type(error).__name__] += 1
        await asyncio.sleep(TLS_TRY_EVERY_S)
    stop.set()
    await asyncio.gather(*idle)
    return {"idle_connections": TLS_IDLE_CONNECTIONS, "seconds": seconds, "https_tries": tries,
            "https_answered": answered, "https_failures": dict(failures),
            "idle_closed_by_server": closed["closed_by_server"],
            "last_idle_closed_after_s": round(closed["last_closed_ms"] / 1000, 1) if closed["closed_by_server"]
            else None}  # fmt: skip


def _ready(flags: list[str], out: str, server_src: str | None, watch_s: float) -> dict:
    """Start ``vlfit serve FLAGS --workers READY_WORKERS --port 0`` and count the connections refused after its
    ready line, until ``watch_s`` seconds after the first one accepted."""
    from vlfit.serve.launch import kill_process_tree, logged_port

    log = os.path.join(out, f"pressure-ready-server-{READY_WORKERS}.log")
    env = {**os.environ, **({"PYTHONPATH": os.path.abspath(server_src)} if server_src else {})}
    started = time.monotonic()
    with open(log, "w") as f, _descriptors(SERVER_NOFILE):
        process = subprocess.Popen([sys.executable, "-m", "vlfit", "serve", *flags, "--workers", str(READY_WORKERS),
                                    "--port", "0"], stdout=f, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        while (port := logged_port(log)) is None:
            if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"vlfit serve gave no ready line (exit {process.poll()}); see {log}")
            time.sleep(0.005)
        line_s = time.monotonic() - started
        tries, refused, first_accept_s, healths = 0, 0, None, []
        while first_accept_s is None or time.monotonic() - started < first_accept_s + watch_s:
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"vlfit serve accepted no connection in {READY_TIMEOUT_S:g} s; see {log}")
            tries += 1
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    first_accept_s = first_accept_s or time.monotonic() - started
            except ConnectionRefusedError:
                refused += 1
            if tries % READY_HEALTH_EVERY == 0 and first_accept_s is not None:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=10) as answer:
                    healths.append(json.load(answer).get("workers"))
            time.sleep(READY_TRY_EVERY_S)
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(60)
    finally:
        kill_process_tree(process)
    return {"workers": READY_WORKERS, "line_s": round(line_s, 2),
            "first_accept_s": None if first_accept_s is None else round(first_accept_s, 2),
            "tries_after_line": tries, "refused_after_line": refused,
            "health_workers": sorted({json.dumps(health) for health in healths}), "exit_code": exit_code}  # fmt: skip


@contextmanager
def on_server_cores(pin: bool):
    """With ``pin`` (Linux), what starts inside runs on the first core (a child inherits it) and this process, the
    load client, on the others from then on: the client's work is then not in the server's latencies, as clients on
    other machines are not. Without it, all share every core."""
    if not pin:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores[1:] or cores)


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


def _start_front(nginx: str, server, out: str) -> front.NginxProcess:
    with _descriptors(SERVER_NOFILE):
        return front.start_nginx(nginx, Path(out).resolve() / "nginx", f"127.0.0.1:{server.port}",
                                 worker_connections=FRONT_WORKER_CONNECTIONS)  # fmt: skip


def serve_pressure(index: str, model: str, out: str, server_flags: list[str] | None = None,
                   server_src: str | None = None, levels: tuple[str, ...] = LEVELS, seconds: float | None = None,
                   front_name: str | None = None, pin: bool = False) -> dict:  # fmt: skip
    """Run ``levels`` (of ``LEVELS``; ``server_flags`` given to every server; each level measuring ``seconds``,
    else its own default), through the front ``front_name`` ("nginx") when given, with the server (and its front)
    on the first core and the load on the others when ``pin``, and return their figures."""
    all_cores = os.sched_getaffinity(0)
    from vlfit.data.synthetic.scenes import scene_and_choices

    nginx = front.find_nginx() if front_name else None
    if front_name and nginx is None:
        raise SystemExit(f"serve_pressure --front nginx: needs Debian's nginx, not installed: {front.INSTALL_HINT}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the client's own connections: thousands
    rng = np.random.default_rng(3)
    texts = [text for _ in range(50) for text in scene_and_choices(rng)[1]]
    requests = [front.search_request(text, k=10) for text in texts]
    forwarded = ["--forwarded_allow_ips", "127.0.0.1"] if nginx else []
    flags = ["--index", index, "--model", model, "--reload_interval", "0", *forwarded, *(server_flags or [])]
    os.makedirs(out, exist_ok=True)
    found: dict = {"resend": [], "capacity_runs": []}
    with on_server_cores(pin):
        server, proxy = _start(flags, os.path.join(out, "pressure-server.log"), server_src), None
        try:
            proxy = _start_front(nginx, server, out) if nginx else None
        except BaseException:
            _stop(server)
            raise
    try:
        base = proxy.url if proxy else server.url
        asyncio.run(closed_loop(base, requests, 8, WARM_UP_S))  # first allocations, caches: not measured
        found["unloaded"] = asyncio.run(unloaded(base, requests))
        closed = RESEND_LEVELS if "resend" in levels else CAPACITY_LEVELS if "overload" in levels else ()
        for clients in closed:
            found["resend" if "resend" in levels else "capacity_runs"].append(
                asyncio.run(closed_loop(base, requests, clients, seconds or RESEND_S))
            )
            print(json.dumps({"closed_loop": (found["resend"] or found["capacity_runs"])[-1]}), flush=True)
        capacity = max((run["answered_qps"] for run in found["resend"] + found["capacity_runs"]), default=0)
        found["capacity_qps"] = capacity
        if "overload" in levels:
            found["overload"] = _overload(base, requests, capacity, found["unloaded"]["p50_ms"], seconds or OVERLOAD_S)
        pause = HOG_CLIENTS * FRONT_PAUSE_S if proxy else 0.0
        for kind in ("hog", "slow"):
            if kind in levels:
                found[kind] = asyncio.run(_crowded(base, requests, kind, seconds or CROWD_S, pause))
        if "over_rate" in levels:
            found["over_rate"] = asyncio.run(_over_rate(base, texts, seconds or RATE_S))
            print(json.dumps({"over_rate": found["over_rate"]}), flush=True)
        if "tls" in levels and proxy:  # the front's own port is TLS
            found["tls_idle"] = asyncio.run(_tls_idle(base, seconds or TLS_S))
    finally:
        if proxy is not None:
            front.stop_nginx(proxy.process)
        _stop(server)
    for level in found["resend"]:
        level["of_best"] = _ratio(level["answered_qps"], capacity, 3)
        level["p99_over_unloaded_p50"] = _ratio(level["p99_ms"], found["unloaded"]["p50_ms"], 1)
    if "tls" in levels and not proxy:
        cert, key = (str(front.CERT_DIR / name) for name in ("loopback-cert.pem", "loopback-key.pem"))
        os.sched_setaffinity(0, all_cores)
        with on_server_cores(pin):
            tls_server = _start([*flags, "--ssl_certfile", cert, "--ssl_keyfile", key],
                                os.path.join(out, "pressure-tls-server.log"), server_src)  # fmt: skip
        try:
            found["tls_idle"] = asyncio.run(_tls_idle(tls_server.url, seconds or TLS_S))
        finally:
            _stop(tls_server)
    if "tls_idle" in found:
        print(json.dumps({"tls_idle": found["tls_idle"]}), flush=True)
    os.sched_setaffinity(0, all_cores)
    if "ready" in levels:  # its two workers on every core, as --workers 2 is meant
        found["ready"] = _ready(flags, out, server_src, seconds or READY_WATCH_S)
        print(json.dumps({"ready": found["ready"]}), flush=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"front": front_name, "server_src": server_src, "server_flags": server_flags or [],
            "server_nofile": SERVER_NOFILE, "pinned": pin, **found}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", required=True, help="An index folder (serve_load.py writes one of 10^5 vectors).")
    parser.add_argument("--model", required=True, help="The model or export the server embeds queries with.")
    parser.add_argument("--out", default="runs/serve-pressure")
    parser.add_argument("--front", choices=("nginx",), default=None,
                        help="Send the load through this front (deploy/nginx/vlfit.conf), not to vlfit.")  # fmt: skip
    parser.add_argument("--server_src", default=None, help="Run the server from this src folder (PYTHONPATH).")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS), help="The levels to run.")
    parser.add_argument("--seconds", type=float, default=None, help="How long each level measures (a smoke run: 2).")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="Linux: the server (and its front) on the first core, the load client on the others.",
    )
    parser.add_argument("--server_flags", nargs=argparse.REMAINDER, default=[],
                        help="Flags of vlfit serve (last: everything after it is passed on).")  # fmt: skip
    args = parser.parse_args()
    found = serve_pressure(args.index, args.model, args.out, args.server_flags, args.server_src, tuple(args.levels),
                           args.seconds, args.front, args.pin)  # fmt: skip
    results = {"load_average": os.getloadavg(), **found}
    name = f"serve_pressure{'-' + args.front if args.front else ''}{'-pinned' if args.pin else ''}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
