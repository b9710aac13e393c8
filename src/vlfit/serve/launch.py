"""Starting ``vlfit serve`` as a process of its own and waiting until it answers (benchmarks, tests, scripts)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from vlfit.errors import UserError


class ServerStartError(UserError):
    """``vlfit serve`` exited, or did not answer ``/api/health`` in time (the message quotes its log)."""


def start_server(
    flags: Sequence[str], port: int, log_path: str, *, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Run ``python -m vlfit serve FLAGS --port PORT`` (output to ``log_path``) and return once it answers on
    ``http://127.0.0.1:PORT/api/health``.

    Raises:
        ServerStartError: when the process exits first, or ``timeout`` seconds pass (the process is killed then).
    """
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vlfit", "serve", *flags, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ServerStartError(f"vlfit serve exited {process.returncode}: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as answer:
                if answer.status == 200:
                    return process
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            kill_process_tree(process)
            raise ServerStartError(f"vlfit serve did not answer within {timeout:g} s: {_tail(log_path)}")
        time.sleep(0.25)


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
