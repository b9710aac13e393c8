"""``vlfit serve`` says it runs once it accepts: from the log's ``Uvicorn running on`` line (what a script waits
for, and ``vlfit.serve.launch`` reads the ``--port 0`` port from) no connection is refused and ``/api/health`` says
every worker is ready, with one process and with ``--workers 2``; a worker that ends before it is ready stops the
server in one line, exit code 1 (``vlfit.serve.readiness``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

START_TIMEOUT = 120  # seconds for the workers to load the model, far above what it takes
WATCH_SECONDS = 3.0  # how long connections are opened after the line
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _start(served_index: Path, workers: int, log: Path) -> subprocess.Popen:
    flags = ["--index", str(served_index), "--workers", str(workers), "--port", "0", "--reload_interval", "0"]
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "vlfit", "serve", *flags], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **ENV})  # fmt: skip


def _wait_for_line(process: subprocess.Popen, log: Path) -> int:
    """The port of the log's line that the server runs, read as soon as it is written."""
    from vlfit.serve.launch import logged_port

    deadline = time.monotonic() + START_TIMEOUT
    while (port := logged_port(str(log))) is None:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.01)
    return port


@pytest.mark.parametrize("workers", [2])  # one process binds after the model loads: tests/serve/test_app.py's health
def test_from_the_line_that_it_runs_no_connection_is_refused_and_every_worker_is_ready(
    served_index, tmp_path, workers
) -> None:
    from vlfit.serve.launch import kill_process_tree

    log = tmp_path / "server.log"
    process = _start(served_index, workers, log)
    try:
        port = _wait_for_line(process, log)
        refused, opened, healths = 0, 0, []
        deadline = time.monotonic() + WATCH_SECONDS
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    opened += 1
            except ConnectionRefusedError:
                refused += 1
            if opened and opened % 50 == 0:  # now and then a whole request, on a new connection
                try:
                    healths.append(httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=10).json()["workers"])
                except httpx.ConnectError:
                    refused += 1
        assert refused == 0, f"{refused} connections refused after the line ({opened} accepted)"
        assert healths and all(health == {"ready": workers, "of": workers} for health in healths), healths
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        kill_process_tree(process)


def test_a_worker_that_ends_before_it_is_ready_stops_the_server_in_one_line(served_index, tmp_path) -> None:
    import psutil

    from vlfit.serve.launch import kill_process_tree

    log = tmp_path / "server.log"
    process = _start(served_index, 2, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # a worker as it starts (the kernel's out-of-memory killer would do the same)
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            workers = [child for child in psutil.Process(process.pid).children()
                       if "spawn_main" in " ".join(child.cmdline())]  # fmt: skip
            if workers:
                break
            time.sleep(0.05)
        workers[0].kill()
        assert process.wait(timeout=30) == 1, log.read_text()[-3000:]
        text = log.read_text()
        assert "Uvicorn running on" not in text, text[-3000:]
        (line,) = [line for line in text.splitlines() if "before all 2 were ready" in line]
        assert f"[{workers[0].pid}] (exit code -9)" in line, line
    finally:
        kill_process_tree(process)


def test_a_worker_says_it_is_ready_from_its_lifespan_and_health_counts_the_workers_alive(
    served_index, tmp_path, monkeypatch
) -> None:
    """What a worker of --workers 2 builds (in this process): ready once its lifespan started, counted by
    /api/health with the workers alive (a file left by a process that is gone is not), not ready once stopped."""
    from fastapi.testclient import TestClient

    from vlfit.commands.serve import SETTINGS_ENV, ServeArguments, app_from_environment, worker_settings
    from vlfit.serve.readiness import WorkerCount

    settings = ServeArguments(index=str(served_index), workers=2, reload_interval=0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"ready-{gone.pid}").touch()  # a worker killed after it was ready
    monkeypatch.setenv(SETTINGS_ENV, worker_settings(settings, None, {}, str(tmp_path)))
    app = app_from_environment()
    assert WorkerCount(str(tmp_path), 2).ready_pids() == set()
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/api/health").json()["workers"] == {"ready": 1, "of": 2}
        assert WorkerCount(str(tmp_path), 2).ready_pids() == {os.getpid()}
    assert WorkerCount(str(tmp_path), 2).ready_pids() == set()
