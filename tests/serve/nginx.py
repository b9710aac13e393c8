"""Debian's nginx with ``deploy/nginx/vlfit.conf`` in front of a ``vlfit serve`` process, as a process of the test.

``scripts/system-packages.sh`` (run by ``make test`` and ``.ci/run``) installs nginx where it can. Where it is still
missing the tests that need it are skipped with the reason, except under CI (``CI=true``): there they fail, as the
browser test does (``tests.serve.browser``).

``start_nginx`` fills the shipped file's placeholders and includes it in a main configuration of its own, in place of
Debian's /etc/nginx/nginx.conf: everything nginx writes (pid, logs, buffered bodies) goes under one folder, so it
runs as any user, and ``worker_connections`` is small enough that a test can run it out.

The clients that press it (each from a loopback address of its own, ``127.0.0.N``: Linux routes all of 127/8 to lo)
are here too, for the test and for ``benchmarks/serve_pressure.py`` (its ``--front nginx`` starts this nginx, and
its clients connect and read answers with ``connect`` and ``read_answer``, to the front or to vlfit alike): searches
one after another (``queries``), idle connections reopened as soon as they are closed (``Flood``, in a process of its
own), and bodies trickled a byte a second (``trickle``).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from tests.serve.browser import under_ci

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "nginx" / "vlfit.conf"
CERT_DIR = Path(__file__).resolve().parent / "data"
DEBIAN_NGINX = "/usr/sbin/nginx"  # found with /usr/sbin off PATH, as it is for a user on Debian
INSTALL_HINT = "scripts/system-packages.sh installs it where it can (apt-get, and root or sudo without a password)"
CONNECT_TIMEOUT = 5.0
ANSWER_TIMEOUT = 10.0
SEARCH = "/api/search"
_PLACEHOLDER = re.compile(r"\$\{(VLFIT_[A-Z_]+)\}")

# The parts of Debian's /etc/nginx/nginx.conf that the shipped file leaves to it, with every path under {folder}.
_MAIN = """\
{user}worker_processes 1;
error_log {folder}/error.log warn;
events {{
    worker_connections {worker_connections};
}}
http {{
    log_format timed '$remote_addr "$request" $status $request_time $upstream_addr';
    access_log {folder}/access.log timed;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    include {folder}/vlfit.conf;
}}
"""


def find_nginx() -> str | None:
    """The nginx executable, ``None`` when not installed."""
    return shutil.which("nginx") or (DEBIAN_NGINX if os.path.exists(DEBIAN_NGINX) else None)


def nginx_verdict(nginx: str | None, ci: bool) -> tuple[Literal["run", "skip", "fail"], str]:
    """What a test of the nginx front does: ``("run", "")``, or skip or fail with the reason to show.

    Args:
        nginx: The nginx executable, or ``None``.
        ci: Whether CI runs the tests (a missing nginx then fails the test instead of skipping it).
    """
    if nginx is not None:
        return "run", ""
    reason = f"the nginx front's test needs Debian's nginx, not installed: {INSTALL_HINT}"
    if ci:
        return "fail", f"{reason} (CI=true: a missing nginx fails this test instead of skipping it)"
    return "skip", reason


def require_nginx() -> str:
    """The nginx executable; the test is skipped (failed under CI) without one."""
    import pytest

    nginx = find_nginx()
    verdict, reason = nginx_verdict(nginx, under_ci(os.environ))
    if verdict == "skip":
        pytest.skip(reason)
    if verdict == "fail":
        pytest.fail(reason)
    assert nginx is not None
    return nginx


def render(template: str, values: dict[str, str]) -> str:
    """``template`` with each ``${VLFIT_NAME}`` placeholder replaced by ``values[NAME]`` (nginx's own ``$variables``
    left alone).

    Raises:
        KeyError: naming a placeholder ``values`` does not fill.
    """
    return _PLACEHOLDER.sub(lambda found: values[found.group(1)], template)


@dataclass(frozen=True)
class NginxProcess:
    """An nginx master process (``daemon off``) listening with TLS on ``127.0.0.1:port``, and its folder."""

    process: subprocess.Popen
    port: int
    folder: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def error_log(self) -> str:
        return (self.folder / "error.log").read_text(errors="replace")

    @property
    def access_log(self) -> str:
        return (self.folder / "access.log").read_text(errors="replace")


def client_context() -> ssl.SSLContext:
    """A TLS client context that trusts the tests' loopback certificate (the one the front serves)."""
    return ssl.create_default_context(cafile=str(CERT_DIR / "loopback-cert.pem"))


def nginx_command(nginx: str, folder: Path, port: int, upstream: str, worker_connections: int = 512) -> list[str]:
    """Write the configuration under ``folder`` (``deploy/nginx/vlfit.conf`` filled for ``127.0.0.1:port`` in front
    of ``upstream``, included by a main file of its own) and return the command that runs nginx on it, in the
    foreground, every file it writes under ``folder`` (add ``-t`` to check it only)."""
    folder.mkdir(parents=True, exist_ok=True)
    values = {"SERVER_NAME": "127.0.0.1", "LISTEN": f"127.0.0.1:{port}", "UPSTREAM": upstream,
              "TLS_CERT": str(CERT_DIR / "loopback-cert.pem"),
              "TLS_KEY": str(CERT_DIR / "loopback-key.pem")}  # fmt: skip
    (folder / "vlfit.conf").write_text(render(CONFIG.read_text(), {f"VLFIT_{k}": v for k, v in values.items()}))
    # As root the workers would run as nobody, who cannot enter a test's private temporary folder.
    user = "user root;\n" if os.geteuid() == 0 else ""
    (folder / "nginx.conf").write_text(_MAIN.format(user=user, worker_connections=worker_connections, folder=folder))
    return [nginx, "-p", str(folder), "-c", str(folder / "nginx.conf"), "-e", str(folder / "error.log"),
            "-g", f"daemon off; pid {folder / 'nginx.pid'};"]  # fmt: skip


def start_nginx(
    nginx: str, folder: Path, upstream: str, *, worker_connections: int = 512, timeout: float = 20.0
) -> NginxProcess:
    """Run ``nginx`` with ``deploy/nginx/vlfit.conf`` on a free loopback port in front of ``upstream``
    (``127.0.0.1:PORT`` of a ``vlfit serve``), everything it writes under ``folder``; return once it completes a TLS
    handshake. A port taken between its pick and nginx's bind is picked again (three tries).

    Raises:
        RuntimeError: nginx exited or did not accept within ``timeout`` seconds (its error log quoted).
    """
    for attempt in range(3):
        port = _free_port()
        command = nginx_command(nginx, folder, port, upstream, worker_connections)
        with open(folder / "nginx.out", "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            if _handshakes(port):
                return NginxProcess(process, port, folder)
            time.sleep(0.1)
        stop_nginx(process)
        errors = "".join(path.read_text(errors="replace") for path in (folder / "error.log", folder / "nginx.out")
                         if path.exists())  # fmt: skip
        if "Address already in use" not in errors or attempt == 2:
            raise RuntimeError(f"nginx did not start: {errors[-2000:]}")
    raise AssertionError("unreachable")


def stop_nginx(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop an nginx master and its workers: SIGTERM (nginx's fast shutdown), SIGKILL after ``timeout`` seconds."""
    from vlfit.serve.launch import kill_process_tree

    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(process)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _handshakes(port: int) -> bool:
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=1) as raw,
            client_context().wrap_socket(raw, server_hostname="127.0.0.1"),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    @property
    def closes(self) -> bool:
        """Whether the server closes the connection after this answer (``Connection: close``)."""
        return self.headers.get(b"connection", b"").lower() == b"close"


@dataclass
class Tally:
    """What one client's queries got: statuses (``failed``: no answer), answered ones' times, refusals."""

    statuses: Counter = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)
    refusals: list[Answer] = field(default_factory=list)

    def answered(self) -> float:
        return self.statuses[200] / max(1, sum(self.statuses.values()))

    def p50_ms(self) -> float:
        return round(1000 * sorted(self.seconds)[len(self.seconds) // 2], 1) if self.seconds else float("nan")


def search_request(text: str, k: int = 2) -> bytes:
    body = json.dumps({"text": text, "k": k}).encode()
    head = f"POST {SEARCH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def connect(base: str, address: str, *, tls: bool | None = None):
    """A connection from ``address`` to the server at ``base`` (``http(s)://127.0.0.1:PORT``), over TLS when
    ``base`` is HTTPS (``tls=False``: plain TCP whatever it is)."""
    url = urlsplit(base)
    tls = url.scheme == "https" if tls is None else tls
    return await asyncio.wait_for(
        asyncio.open_connection(url.hostname, url.port, local_addr=(address, 0), ssl=client_context() if tls else None,
                                server_hostname=url.hostname if tls else None),
        CONNECT_TIMEOUT,
    )  # fmt: skip


async def read_answer(reader: asyncio.StreamReader, timeout: float = ANSWER_TIMEOUT) -> Answer:
    """The answer to a request sent on ``reader``'s connection: its head within ``timeout`` seconds, then its body
    (``Content-Length`` bytes) within as many."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines[1:] if b":" in line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get(b"content-length", b"0"))), timeout)
    return Answer(int(lines[0].split(b" ", 2)[1]), headers, body)


async def ask(base: str, address: str, request: bytes) -> tuple[Answer | None, float]:
    """One request on a connection of its own (one kept idle could be closed under a flood), and its time."""
    started = time.perf_counter()
    try:
        reader, writer = await connect(base, address)
    except (OSError, asyncio.TimeoutError):
        return None, 0.0
    try:
        writer.write(request)
        return await read_answer(reader), time.perf_counter() - started
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError):
        return None, 0.0
    finally:
        writer.close()


async def queries(base: str, address: str, texts: list[str], count: int, pause: float) -> Tally:
    """``count`` searches from ``address``, one after another with ``pause`` seconds between them."""
    tally = Tally()
    for n in range(count):
        answer, seconds = await ask(base, address, search_request(texts[n % len(texts)]))
        tally.statuses[answer.status if answer else "failed"] += 1
        if answer is not None and answer.status == 200:
            tally.seconds.append(seconds)
        elif answer is not None:
            tally.refusals.append(answer)
        await asyncio.sleep(pause)
    return tally


async def back_to_back(base: str, address: str, texts: list[str], seconds: float) -> Tally:
    """Searches from ``address`` on one kept-open connection for ``seconds``, each sent as soon as the last is
    answered (refused or not; a new connection when the server closes one)."""
    tally, started = Tally(), time.monotonic()
    reader, writer = await connect(base, address)
    try:
        while time.monotonic() - started < seconds:
            writer.write(search_request(texts[sum(tally.statuses.values()) % len(texts)]))
            answer = await read_answer(reader)
            tally.statuses[answer.status] += 1
            if answer.status != 200:
                tally.refusals.append(answer)
            if answer.closes:
                writer.close()
                reader, writer = await connect(base, address)
    finally:
        writer.close()
    return tally


async def _hold_idle(base: str, address: str, stop: asyncio.Event, counts: Counter) -> None:
    """One connection slot held from ``address``: a TCP connection that sends nothing (to an HTTPS server, a
    handshake never started), opened again as soon as the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await connect(base, address, tls=False)
        except (OSError, asyncio.TimeoutError):
            counts["connect_failed"] += 1
            await asyncio.sleep(0.05)
            continue
        counts["opened"] += 1
        closed, stopped = asyncio.ensure_future(reader.read(1)), asyncio.ensure_future(stop.wait())
        await asyncio.wait({closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if closed.done():
            counts["closed_by_server"] += 1
        for waiter in (closed, stopped):
            waiter.cancel()
        writer.close()


def _flood_process(base: str, addresses: list[str], each: int, seconds: float, closed) -> None:
    async def hold_all() -> None:
        stop, counts = asyncio.Event(), Counter()
        holders = [asyncio.ensure_future(_hold_idle(base, address, stop, counts))
                   for address in addresses for _ in range(each)]  # fmt: skip
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*holders), CONNECT_TIMEOUT + 5)
        closed.value = counts["closed_by_server"]

    asyncio.run(hold_all())


class Flood:
    """While entered: ``each`` idle connections from each of ``addresses`` for ``seconds``, reopened as soon as
    the server closes one, in a process of its own (a client on other machines: its reconnecting is not in the
    event loop that times the other clients). ``closed_by_server``: how many the server closed, once it is over.
    """

    def __init__(self, base: str, addresses: list[str], each: int, seconds: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._closed = context.Value("q", -1)
        self._process = context.Process(target=_flood_process, args=(base, addresses, each, seconds, self._closed))
        self._seconds = seconds

    def __enter__(self) -> Flood:
        self._process.start()
        return self

    def __exit__(self, *exc) -> None:
        self._process.join(self._seconds + 30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)

    @property
    def closed_by_server(self) -> int:
        return self._closed.value


async def trickle(base: str, address: str, stop: asyncio.Event, outcomes: Counter, refusals: list[Answer]) -> None:
    """A search whose body (1000 bytes declared) arrives a byte a second until ``stop`` (``outcomes``:
    ``still_sending``); an answer before that (a refusal) is counted by status and kept in ``refusals``."""
    try:
        reader, writer = await connect(base, address)
    except (OSError, asyncio.TimeoutError):
        outcomes["connect_failed"] += 1
        return
    try:
        writer.write(f"POST {SEARCH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n{".encode())  # fmt: skip
        while not stop.is_set():
            try:
                answer = await asyncio.wait_for(read_answer(reader), 1.0)
            except asyncio.TimeoutError:
                writer.write(b" ")
                continue
            outcomes[answer.status] += 1
            refusals.append(answer)
            return
        outcomes["still_sending"] += 1
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        outcomes["broken"] += 1
    finally:
        writer.close()
