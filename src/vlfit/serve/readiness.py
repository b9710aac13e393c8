"""Ready means accepting: ``vlfit serve --workers N`` logs the line that says it runs (uvicorn's ``Uvicorn running
on http://HOST:PORT (Press CTRL+C to quit)``, the port it bound with ``--port 0``) once every worker accepts, and
``/api/health`` says how many workers are ready.

uvicorn's supervisor binds the port and logs that line before it starts the workers; each worker then loads the
model and the index (the app factory) and runs the app's lifespan before it listens on the shared socket, and
until the first one listens every connection is refused (1,073 in the 14.5 s two workers took to load). Here the
line is held back as the socket binds (``StartLine``) and logged by the supervisor (``ReadySupervisor``, uvicorn's
``Multiprocess``) once every worker has said it is ready and the socket listens. A worker says so with a file of
its pid in the workers' private folder, written when its lifespan's startup is done (``WorkerCount.started``:
its app loaded, it listens a moment later, and connections queue meanwhile on the socket the others listen on);
each worker's ``/api/health`` counts the files of the workers alive.

A worker that ends before the line (its model does not load, the kernel kills it for memory, uvicorn kills it for
not answering) stops the server: one line says which worker and how it ended, and ``vlfit serve`` exits 1; every
restart would load the same model the same way. After the line a worker that dies is restarted, as uvicorn does,
and ``/api/health`` counts it again once its replacement is ready. One process (``--workers 1``) loads its app
before it binds and uvicorn logs the line once it listens: ``WorkerCount()`` says 1 of 1.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
from dataclasses import dataclass

from uvicorn import Config, Server
from uvicorn.supervisors import Multiprocess

logger = logging.getLogger(__name__)

START_LINE = "Uvicorn running on"  # how uvicorn's line that the server runs begins (vlfit.serve.launch reads it)
READY_PREFIX = "ready-"  # a worker's file in the ready folder: ready-PID


@dataclass(frozen=True)
class WorkerCount:
    """The server's processes that are ready: with ``folder``, the ``of`` workers of ``--workers N``, each ready
    once its file is there (``started``) while it lives; without, one process, ready as it answers."""

    folder: str | None = None
    of: int = 1

    def started(self) -> None:
        """Say this worker is ready (its app loaded, its lifespan's startup done)."""
        if self.folder is not None:
            with open(self._file(os.getpid()), "w"):
                pass

    def stopped(self) -> None:
        if self.folder is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._file(os.getpid()))

    def ready_pids(self) -> set[int]:
        """The pids of the workers ready and alive (one process: this one)."""
        if self.folder is None:
            return {os.getpid()}
        names = [name for name in os.listdir(self.folder) if name.startswith(READY_PREFIX)]
        return {pid for pid in (int(name[len(READY_PREFIX) :]) for name in names) if _alive(pid)}

    def read(self) -> dict[str, int]:
        """``{"ready": R, "of": N}``, what ``/api/health`` says of the workers."""
        return {"ready": len(self.ready_pids()), "of": self.of}

    def _file(self, pid: int) -> str:
        return os.path.join(self.folder or "", f"{READY_PREFIX}{pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the pid: not a worker
        return False
    return True


class StartLine(logging.Filter):
    """Holds back uvicorn's line that the server runs (logged as the socket binds) until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(START_LINE):
            self.held.append(record)
            return False
        return True

    def release(self) -> None:
        """Log the lines held back, as uvicorn logged them (the same logger, level, text and colours)."""
        for record in self.held:
            extra = {"color_message": record.color_message} if hasattr(record, "color_message") else None
            logging.getLogger(record.name).log(record.levelno, record.msg, *(record.args or ()), extra=extra)
        self.held.clear()


class ReadySupervisor(Multiprocess):
    """uvicorn's supervisor of ``config.workers`` processes that logs the start line held back once every worker
    is ready and the socket listens, and stops when a worker ends before that (``failure`` says how)."""

    def __init__(self, config: Config, sockets: list[socket.socket], count: WorkerCount, line: StartLine) -> None:
        # an older uvicorn (0.50 and before) hands its supervisor the server's run; 0.53 makes a Server per worker
        given = {"target": Server(config).run} if "target" in inspect.signature(Multiprocess).parameters else {}
        super().__init__(config, sockets=sockets, **given)
        self.count, self.line = count, line
        self.announced = False
        self.failure: str | None = None

    def keep_subprocess_alive(self) -> None:  # every half second, from uvicorn's loop in run()
        if self.should_exit.is_set():
            return
        watched = list(self.processes)
        if not self.announced and self._ended_before_ready(watched):
            return  # no replacement started: run() stops the others
        super().keep_subprocess_alive()  # restarts a worker that died (or hung: killed first)
        if self.should_exit.is_set():  # uvicorn gave up: a worker failed to start (its exit code 3)
            self._fail(next((worker for worker in watched if worker.process.exitcode is not None), None))
        elif not self.announced and not self._ended_before_ready(watched) and self._all_ready():
            self.announced = True
            self.line.release()

    def _all_ready(self) -> bool:
        pids = {worker.pid for worker in self.processes}
        listening = self.sockets[0].getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        return bool(listening) and pids <= self.count.ready_pids()

    def _ended_before_ready(self, workers: list) -> bool:
        if self.signal_queue:  # a stop signal (Ctrl-C reaches the workers too): ending is what they were told
            return False
        ended = next((worker for worker in workers if worker.process.exitcode is not None), None)
        if ended is not None:
            self._fail(ended)
            self.should_exit.set()
        return ended is not None

    def _fail(self, worker) -> None:  # noqa: ANN001 - uvicorn's Process
        how = "" if worker is None else f" [{worker.pid}] (exit code {worker.process.exitcode})"
        when = "after the server was up" if self.announced else f"before all {self.processes_num} were ready"
        self.failure = f"a worker process{how} ended {when}; its error is above. Stopping the server."
        logger.error(self.failure)


def run_workers(config: Config, count: WorkerCount) -> bool:
    """Bind ``config``'s port and run its ``config.workers`` processes until a signal stops them, saying the
    server runs once every worker accepts. Returns False when a worker ended before that, or failed to start
    (said in one line), True otherwise."""
    line, uvicorn_log = StartLine(), logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(line)
    try:
        sock = config.bind_socket()
    finally:
        uvicorn_log.removeFilter(line)
    supervisor = ReadySupervisor(config, [sock], count, line)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C stops the workers, then returns
        supervisor.run()
    return supervisor.failure is None
