"""Starting ``vlfit serve`` as a process of its own and waiting until it answers (benchmarks, tests, scripts)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from vlfit.errors import UserError

# The line vlfit serve logs once it accepts connections (with --workers N, once every worker does:
# vlfit.serve.readiness), with the port it bound (the free one it was given with --port 0).
_LISTENING = re.compile(r"Uvicorn running on https?://\S+?:(\d+) ")


class ServerStartError(UserError):
    """``vlfit serve`` exited, or did not answer ``/api/health`` in time (the message quotes its log)."""


@dataclass(frozen=True)
class ServerProcess:
    """A ``vlfit serve`` process that answers, and the loopback port it listens on."""

    process: subprocess.Popen
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


def start_server(
    flags: Sequence[str], log_path: str, *, port: int = 0, timeout: float = 120.0, env: dict[str, str] | None = None
) -> ServerProcess:
    """Run ``python -m vlfit serve FLAGS --port PORT`` (output to ``log_path``) and return once it answers on
    ``http://127.0.0.1:PORT/api/health``.

    ``port`` 0 (the default) lets the server bind a free port itself and reads which from its log: no port is
    picked here and bound there later, where another process could take it in between. The answer must come from
    the process or one of its workers (``/api/health`` names its pid), not from another server on the port.

    Raises:
        ServerStartError: when the process exits first, or ``timeout`` seconds pass (the process is killed then).
    """
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vlfit", "serve", *flags, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
    scheme = "https" if "--ssl_certfile" in flags else "http"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ServerStartError(f"vlfit serve exited {process.returncode}: {_tail(log_path)}")
        port = port or logged_port(log_path) or 0  # read once the log names it
        if port and _answers(f"{scheme}://127.0.0.1:{port}", process):
            return ServerProcess(process, port, scheme)
        if time.monotonic() > deadline:
            kill_process_tree(process)
            raise ServerStartError(f"vlfit serve did not answer within {timeout:g} s: {_tail(log_path)}")
        time.sleep(0.25)


def logged_port(log_path: str) -> int | None:
    """The port the server's log says it accepts connections on; None before it says so."""
    found = _LISTENING.search(_tail(log_path, size=1 << 20))
    return int(found.group(1)) if found else None


def _answers(base: str, process: subprocess.Popen) -> bool:
    """Whether ``/api/health`` at ``base`` answers 200 from ``process`` or one of the workers it started (over
    HTTPS, whatever certificate the process was given: it is the process started here, on loopback)."""
    import psutil

    context = ssl._create_unverified_context() if base.startswith("https:") else None
    try:
        with urllib.request.urlopen(f"{base}/api/health", timeout=2, context=context) as answer:
            pid = json.load(answer).get("pid") if answer.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return False
    if pid == process.pid:
        return True
    try:
        return pid in {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return False


def kill_process_tree(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILL ``process`` and every process it started (uvicorn's workers outlive a killed supervisor)."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for victim in [*children]:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    process.kill()
    process.wait(timeout)
    psutil.wait_procs(children, timeout=timeout)


def _tail(path: str, size: int = 3000) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-size:]
