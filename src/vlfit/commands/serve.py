"""``vlfit serve``: an index and its model as an HTTP search API with a web page (FastAPI on uvicorn).

    vlfit serve --index runs/index [--host 127.0.0.1] [--port 8000] [--workers 1]

The model (or its exported graphs, as ``--backend auto`` picks for ``vlfit retrieve query``) and the index are
loaded once per worker process; see ``vlfit.serve.app`` for the routes. With ``--workers N``, ``/metrics`` counts
the requests of every worker (prometheus_client's multiprocess mode, in a temporary folder removed at exit), and
the keys reach the workers in files of a private temporary folder, removed at exit, never through the environment.
The log's ``Uvicorn running on`` line (with the port ``--port 0`` bound) comes once every worker accepts
(``vlfit.serve.readiness``); a worker that ends before that stops the server, exit code 1. SIGTERM or Ctrl-C
finishes the requests in flight, then exits 0.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Literal

from vlfit.arguments.runtime import flags_of, runtime_arguments
from vlfit.commands.parsing import CommandParser
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.inference.rerank_score import check_rerank_weight
from vlfit.logs import configure_third_parties, log_level
from vlfit.serve.access import ADMIN_KEY_ENV, API_KEY_ENV, AccessPolicy, allowed_hosts, exposure_warning, read_key
from vlfit.serve.limits import ServerLimits

PROG = "vlfit serve"
logger = logging.getLogger(__name__)
SETTINGS_ENV = "VLFIT_SERVE_SETTINGS"  # how --workers > 1 hands the settings to uvicorn's worker processes


@dataclass
class ServeArguments(runtime_arguments(num_threads=1), flags_of(ServerLimits)):
    """Flags of ``vlfit serve``."""

    index: str = flag(help="The index folder (vlfit retrieve index's output).")
    verify: Literal["quick", "full"] = flag(
        "quick",
        "How the index is checked as it opens and reloads: quick (each file there with its "
        "recorded size) or full (checksums and finite embeddings too: reads the whole index).",
    )
    host: str = flag("127.0.0.1", "Address to bind (0.0.0.0: every interface).")
    port: int = flag(8000, "TCP port (0: any free one, printed at start).")
    workers: int = flag(1, "Server processes, each with its own model and index.")
    model: str | None = flag(None, "The model to embed queries with (default: the one the index was built with).")
    rerank_score: Literal["itm", "itm+itc"] | None = flag(
        None,
        'What a query\'s re-ranked candidates (its "rerank": K) are ordered by unless it says '
        '("rerank_score"): itm (the matching log-odds) or itm+itc (plus --rerank_weight times the '
        "cosine). Default: itm+itc when the model's run saved a weight (rerank.json), else itm.",
    )
    rerank_weight: float | None = flag(
        None, "The cosine's weight in itm+itc re-ranking (default: the one the model's run saved)."
    )
    max_upload_mb: float = flag(20.0, "Largest request body in MB (413 beyond).")
    max_batch: int = flag(32, "Most text queries embedded in one batch.")
    max_wait_ms: float = flag(0.0, "How long a batch waits for more text queries after those that queued (0: none).")
    search_threads: int = flag(
        1, "faiss threads per search (1: batching makes the concurrency; spinning threads steal cores)."
    )
    reload_interval: float = flag(2.0, "Seconds between checks for a new index manifest (0: POST /api/reload only).")
    api_key: str | None = flag(
        None,
        f"Key every route but the page and /api/health needs (Authorization: Bearer KEY); also "
        f"--api_key_file or ${API_KEY_ENV}. Never logged.",
        repr=False,
    )
    api_key_file: str | None = flag(None, "A file whose first line is --api_key.")
    admin_key: str | None = flag(
        None,
        f"Key POST /api/reload needs (default: --api_key; with no key at all, reload is answered "
        f"to loopback clients only); also --admin_key_file or ${ADMIN_KEY_ENV}. Never logged.",
        repr=False,
    )
    admin_key_file: str | None = flag(None, "A file whose first line is --admin_key.")
    allowed_hosts: list[str] | None = flag(
        None,
        "Host header names answered (default: localhost, 127.0.0.1, ::1 and --host); '*': any. "
        "Guards a loopback server against DNS rebinding.",
    )
    show_absolute_paths: bool = flag(
        False,
        "Show results' files, the index and the model as absolute paths (local use); by default "
        "files relative to the folder indexed, the index and model by name.",
    )
    ssl_certfile: str | None = flag(None, "TLS certificate (PEM); serve HTTPS.")
    ssl_keyfile: str | None = flag(None, "TLS private key (PEM) of --ssl_certfile.")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.max_upload_mb <= 0:
            raise ConfigError(f"--max_upload_mb must be positive, got {self.max_upload_mb}")
        if self.max_batch < 1 or self.max_wait_ms < 0 or self.reload_interval < 0:
            raise ConfigError("--max_batch must be at least 1, --max_wait_ms and --reload_interval at least 0")
        if self.search_threads < 1:
            raise ConfigError(f"--search_threads must be at least 1, got {self.search_threads}")
        check_rerank_weight(self.rerank_weight)
        self.limits()  # refuses a limit out of range now, in one line
        self.api_key = read_key(self.api_key, self.api_key_file, API_KEY_ENV, "--api_key")
        self.admin_key = read_key(self.admin_key, self.admin_key_file, ADMIN_KEY_ENV, "--admin_key")
        self.api_key_file = self.admin_key_file = None  # read: --workers N hands them on in files (_worker_folder)
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("--ssl_certfile and --ssl_keyfile go together: give both to serve HTTPS, or neither")
        for option, path in (("--ssl_certfile", self.ssl_certfile), ("--ssl_keyfile", self.ssl_keyfile)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{option} {path}: no such file")

    def access(self) -> AccessPolicy:
        """Who may ask what (``vlfit.serve.access``)."""
        hosts = allowed_hosts(self.allowed_hosts, self.host)
        return AccessPolicy(api_key=self.api_key, admin_key=self.admin_key, allowed_hosts=hosts)

    def limits(self) -> ServerLimits:
        """The server's bounds these flags set."""
        return ServerLimits(**{limit.name: getattr(self, limit.name) for limit in fields(ServerLimits)})


def build_app(args: ServeArguments, verified: tuple[int, int] | None = None, workers=None):  # -> fastapi.FastAPI
    """The app for ``args``: its engine loads the model and the index (checked unless ``verified`` is the stamp of
    its manifest, ``vlfit.index.verify.verified_stamp``); ``workers``: where a worker of ``--workers N`` says it is
    ready (``vlfit.serve.readiness.WorkerCount``; ``None``: one process)."""
    from vlfit.serve.app import create_app
    from vlfit.serve.engine import SearchEngine

    limits, access = args.limits(), args.access()
    if args.ssl_certfile:  # this process's connections (vlfit.serve.tls; each worker of --workers N calls this)
        from vlfit.serve.tls import server_context, use_tls

        use_tls(server_context(args.ssl_certfile, args.ssl_keyfile), handshake_timeout=args.header_timeout)
    engine = SearchEngine(args.index, args.model, args.settings(), search_threads=args.search_threads,
                          verify=args.verify, absolute_paths=args.show_absolute_paths, verified=verified,
                          rerank_score=args.rerank_score, rerank_weight=args.rerank_weight)  # fmt: skip
    return create_app(engine, max_upload_mb=args.max_upload_mb, max_batch=args.max_batch,
                      max_wait_ms=args.max_wait_ms, reload_interval=args.reload_interval,
                      limits=limits, access=access, workers=workers)  # fmt: skip


def _says_https(record: logging.LogRecord) -> bool:
    """uvicorn's start line names the scheme it did the TLS for: with vlfit doing it, ``https``."""
    arguments = record.args
    if isinstance(record.msg, str) and "running on" in record.msg and isinstance(arguments, tuple) and arguments:
        record.args = tuple("https" if arg == "http" else arg for arg in arguments[:1]) + arguments[1:]
    return True


def worker_settings(
    args: ServeArguments, verified: tuple[int, int] | None, key_files: dict[str, str], ready_folder: str | None = None
) -> str:
    """What ``SETTINGS_ENV`` holds for the workers: the flags, and the manifest stamp the parent checked the index
    at (each worker opens that manifest without checking it again). No key: the keys' files (``_worker_folder``), which
    each worker reads as ``--api_key_file``/``--admin_key_file``; an environment is readable by more than the
    process (``/proc/PID/environ``) and passed on to every process it starts. ``ready_folder``: where each worker
    says it is ready (``vlfit.serve.readiness``)."""
    flags = {**asdict(args), "api_key": None, "admin_key": None, **key_files}
    return json.dumps({"flags": flags, "verified": verified, "log_level": log_level(), "ready_folder": ready_folder})


def app_from_environment():  # uvicorn's factory in each worker process of --workers N
    settings = json.loads(os.environ[SETTINGS_ENV])
    from vlfit.serve.readiness import WorkerCount

    configure_third_parties(settings["log_level"])  # a worker is a process of its own: its model loads quietly too
    verified, args = settings["verified"], ServeArguments(**settings["flags"])
    workers = WorkerCount(settings["ready_folder"], args.workers) if settings.get("ready_folder") else None
    return build_app(args, tuple(verified) if verified else None, workers)


def check_address(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, as uvicorn will bind it: a busy port or an address that is not this
    machine's fails here, in one line, before the model and the index load (uvicorn would fail after them).

    Raises:
        ConfigError: naming ``--port`` or ``--host``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's: a port in TIME_WAIT is free
        try:
            probe.bind((host, port))
        except socket.gaierror as error:
            raise ConfigError(f"--host {host}: not an address of this machine ({error.strerror})") from None
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--port {port}: {host}:{port} is in use by another process; stop it or choose another --port "
                    "(0: any free one)"
                ) from None
            if error.errno == errno.EACCES:
                raise ConfigError(
                    f"--port {port}: binding {host}:{port} is not permitted ({error.strerror}); ports below 1024 "
                    "need privileges: choose another --port"
                ) from None
            raise ConfigError(
                f"--host {host}: cannot bind {host}:{port} ({error.strerror}); use 127.0.0.1, 0.0.0.0 (every "
                "interface) or an address of this machine"
            ) from None


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit serve``."""
    (args,) = CommandParser(ServeArguments, prog=PROG).parse_args_into_dataclasses(args=argv)
    check_address(args.host, args.port)  # before anything loads
    import uvicorn

    from vlfit.index.verify import verified_stamp
    from vlfit.serve.access_log import log_config as access_log_config
    from vlfit.serve.connections import http_protocol

    # No index, or a damaged one: one line now, not a traceback in every worker. Checked once: the engines (this
    # process's, or each worker's) open the manifest checked here without checking it again.
    verified = verified_stamp(args.index, args.verify)
    # uvicorn on vlfit's httptools protocol, which bounds connections and request heads by the app's limits
    # (vlfit.serve.connections; h11 where this uvicorn's lacks what it needs); h11's own head limit for h11.
    common = dict(host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30,
                  http=http_protocol(), timeout_keep_alive=args.keep_alive_timeout,
                  h11_max_incomplete_event_size=args.max_header_bytes)  # fmt: skip
    # uvicorn's logging, with secrets in a request's query string kept out of the access log (applied by uvicorn in
    # this process and in each worker).
    common.update(log_config=access_log_config())
    # X-Forwarded-For is read from the proxies the user trusts, and from no one else (uvicorn trusts 127.0.0.1).
    common.update(proxy_headers=args.forwarded_allow_ips is not None, forwarded_allow_ips=args.forwarded_allow_ips)
    if args.ssl_certfile:
        from vlfit.serve.connections import BOUNDED_PROTOCOL
        from vlfit.serve.tls import TLS_PROTOCOL, server_context

        server_context(args.ssl_certfile, args.ssl_keyfile)  # files that do not load: one line, before anything
        if common["http"] == BOUNDED_PROTOCOL:  # vlfit does the TLS, its handshakes bounded (vlfit.serve.tls)
            common.update(http=TLS_PROTOCOL, loop="asyncio")
            logging.getLogger("uvicorn.error").addFilter(_says_https)
        else:
            common.update(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    warning = exposure_warning(args.host, args.access())
    if warning:
        logger.warning(warning)
    # uvicorn finishes the requests in flight on SIGTERM, then raises the signal again: end with 0 then, not -15.
    signal.signal(signal.SIGTERM, _stopped)
    if args.workers == 1:
        # loads the model before binding; uvicorn says it runs once it listens: the port opens ready
        uvicorn.run(build_app(args, verified), **common)
        return 0
    from vlfit.serve.readiness import WorkerCount, run_workers

    with _metrics_folder(), _worker_folder(args) as (folder, key_files):
        ready = WorkerCount(folder, args.workers)
        os.environ[SETTINGS_ENV] = worker_settings(args, verified, key_files, ready.folder)
        config = uvicorn.Config("vlfit.commands.serve:app_from_environment", factory=True, workers=args.workers,
                                **common)  # fmt: skip
        # uvicorn's line that the server runs (and its port) once every worker accepts, not as the port binds
        return 0 if run_workers(config, ready) else 1


@contextlib.contextmanager
def _worker_folder(args: ServeArguments) -> Iterator[tuple[str, dict[str, str]]]:
    """A private folder (0700, temporary) for the workers while they run, removed at exit, and the keys of ``args``
    each in a file there only this user may read (0600), as ``(folder, {"api_key_file": path, ...})``; the workers
    also say there that they are ready (``vlfit.serve.readiness``). ``$VLFIT_API_KEY`` and ``$VLFIT_ADMIN_KEY``
    are taken out of the environment the workers inherit meanwhile (read already: they are in ``args``)."""
    taken = {name: os.environ.pop(name) for name in (API_KEY_ENV, ADMIN_KEY_ENV) if name in os.environ}
    try:
        with tempfile.TemporaryDirectory(prefix="vlfit-serve-keys-") as folder:
            files = {}
            for name, key in (("api_key", args.api_key), ("admin_key", args.admin_key)):
                if key is not None:
                    path = files[f"{name}_file"] = os.path.join(folder, name)
                    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
                        f.write(key + "\n")
            yield folder, files
    finally:
        os.environ.update(taken)


@contextlib.contextmanager
def _metrics_folder() -> Iterator[str]:
    """A fresh folder as ``PROMETHEUS_MULTIPROC_DIR`` while the workers run (they inherit it; prometheus_client
    counts in it, and each worker's ``/metrics`` sums every worker's counts), removed at exit."""
    from vlfit.serve.metrics import MULTIPROCESS_ENV

    before = os.environ.get(MULTIPROCESS_ENV)
    with tempfile.TemporaryDirectory(prefix="vlfit-serve-metrics-") as folder:
        os.environ[MULTIPROCESS_ENV] = folder
        try:
            yield folder
        finally:
            if before is None:
                os.environ.pop(MULTIPROCESS_ENV, None)
            else:
                os.environ[MULTIPROCESS_ENV] = before
