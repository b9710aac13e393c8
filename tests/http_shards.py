"""A real HTTP server on loopback for the streaming tests: tar shards from memory, Range requests, injected faults.

``ShardServer`` listens on 127.0.0.1 on a port the OS picks (``http.server.ThreadingHTTPServer`` in a thread) and
serves the files given to it, honouring ``Range: bytes=a-b`` as fsspec's HTTP files send it (206 with
``Content-Range``), or with ``ranges=False`` ignoring it as ``python -m http.server`` and many static hosts do (200
with the whole file, no ``Accept-Ranges``). Faults are set per path: ``fail`` answers a status (500, 404...) to the
next requests, ``drop`` cuts the connection midway through a body, ``stall`` sends the headers of a GET and then
nothing until the server closes (a stall beyond the client's timeout). ``requests`` logs what was asked. Every wait
is bounded and ``close`` (or leaving the ``with`` block) releases stalled handlers and stops the server. ``down``
makes the server die as a crashed one does (new connections refused, open keep-alive ones cut) and ``up`` brings it
back on the same port.

``webdataset_shard`` writes a shard of small synthetic JPEGs with a ``.txt`` caption and a ``.json`` per sample.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import tarfile
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.data.image_factory import jpeg_bytes

MAX_STALL_S = 10.0  # a stalled handler gives up by itself after this long, even if nobody closes the server


def webdataset_shard(name: str, samples: int, *, seed: int = 0, size: int = 24) -> tuple[bytes, list[dict]]:
    """A tar shard of ``samples`` samples keyed ``<name>-<i>``: ``.jpg``, ``.txt`` and ``.json`` members in order.

    Returns:
        The shard's bytes, and per sample ``{"key", "image", "caption"}`` as they were written.
    """
    buffer, written = io.BytesIO(), []
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for i in range(samples):
            key = f"{name}-{i:04d}"
            image = jpeg_bytes(size, size, quality=80, seed=seed * 1000 + i)
            caption = f"sample {i} of {name}"
            meta = json.dumps({"caption": caption, "index": i}).encode()
            for ext, data in (("jpg", image), ("txt", caption.encode()), ("json", meta)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            written.append({"key": key, "image": image, "caption": caption})
    return buffer.getvalue(), written


def write_files(files: dict[str, bytes], root: Path) -> Path:
    """The served files written under ``root`` at their paths (``"/a/000.tar"`` -> ``root/a/000.tar``): the same
    shards read locally."""
    for path, data in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


@dataclass
class _Fault:
    kind: str  # "status", "drop" or "stall"
    times: int | None  # how many more requests it hits; None: all of them
    status: int = 500
    at_byte: int = 0  # drop: the file offset at which the body is cut
    pause: float = 0.0  # drop: seconds between the last byte sent and the cut


class ShardServer:
    """Files over HTTP on loopback, with faults per path (see the module's docstring)."""

    def __init__(self, files: dict[str, bytes] | None = None, *, ranges: bool = True) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.ranges = ranges
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.headers: list[dict[str, str]] = []  # every request's headers, in the order of `requests`
        self._faults: dict[str, list[_Fault]] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._connections: set[socket.socket] = set()  # open connections (kept alive between requests)
        self._port = 0
        self._start()

    def _start(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), _Handler)  # allow_reuse_address: same port
        self._port = self._server.server_address[1]
        self._server.daemon_threads = True
        self._server.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def __enter__(self) -> ShardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release stalled handlers and stop serving."""
        self._closing.set()
        self._stop()

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def down(self) -> None:
        """Die as a crashed server does: new connections are refused and open ones (kept alive) are cut."""
        # Shut down, not only closed: a forked DataLoader worker holds a copy of the listening socket, which would
        # go on queueing connections nobody accepts (a timeout, where a dead server refuses at once).
        with contextlib.suppress(OSError):
            self._server.socket.shutdown(socket.SHUT_RDWR)
        self._stop()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        """Serve again, on the same port, after ``down``."""
        self._start()

    def url(self, path: str) -> str:
        """The URL of ``path`` (``"/a/000.tar"``)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def fail(self, path: str, status: int = 500, times: int | None = None) -> None:
        """Answer ``status`` to the next ``times`` requests of ``path`` (``None``: to every one)."""
        self._add(path, _Fault("status", times, status=status))

    def drop(self, path: str, at_byte: int, times: int = 1, pause: float = 0.3) -> None:
        """Cut the connection of the next ``times`` GETs of ``path`` whose body reaches file offset ``at_byte``,
        after sending the bytes before it (the headers promise the whole body) and waiting ``pause`` seconds, so
        that the client has read them (aiohttp drops unread bytes once the connection is lost)."""
        self._add(path, _Fault("drop", times, at_byte=at_byte, pause=pause))

    def stall(self, path: str, times: int | None = None) -> None:
        """Send the headers of the next ``times`` GETs of ``path`` and then nothing (HEADs are answered)."""
        self._add(path, _Fault("stall", times))

    def heal(self, path: str) -> None:
        """Drop every fault set on ``path``: it is served normally from now on."""
        with self._lock:
            self._faults.pop(path, None)

    def _add(self, path: str, fault: _Fault) -> None:
        with self._lock:
            self._faults.setdefault(path, []).append(fault)

    def _take_fault(self, method: str, path: str, start: int, end: int) -> _Fault | None:
        """The fault this request meets, counted off its ``times``."""
        with self._lock:
            for fault in self._faults.get(path, []):
                if fault.times == 0:
                    continue
                if fault.kind == "stall" and method != "GET":
                    continue
                if fault.kind == "drop" and (method != "GET" or not start <= fault.at_byte < end):
                    continue
                if fault.times is not None:
                    fault.times -= 1
                return fault
        return None


_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp's connection pool expects
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle's algorithm and the client's delayed ACK
    # hold every response ~40 ms.
    disable_nagle_algorithm = True
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # quiet: the tests read `requests` instead
        pass

    def setup(self) -> None:
        super().setup()
        owner: ShardServer = self.server.owner  # type: ignore[attr-defined]
        with owner._lock:
            owner._connections.add(self.connection)

    def finish(self) -> None:
        owner: ShardServer = self.server.owner  # type: ignore[attr-defined]
        with owner._lock:
            owner._connections.discard(self.connection)
        super().finish()

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_GET(self) -> None:
        self._serve("GET")

    def _serve(self, method: str) -> None:
        owner: ShardServer = self.server.owner  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        requested = self.headers.get("Range")
        with owner._lock:
            owner.requests.append((method, path, requested))
            owner.headers.append(dict(self.headers.items()))
        data = owner.files.get(path)
        size = len(data) if data is not None else 0
        start, end, partial = 0, size, False
        match = _RANGE.match(requested or "")
        if match and data is not None and owner.ranges:
            first, last = match.groups()
            start = int(first) if first else max(0, size - int(last or 0))
            end = min(size, int(last) + 1) if first and last else size
            partial = True
        fault = owner._take_fault(method, path, start, end)
        if fault is not None and fault.kind == "status":
            return self._empty(fault.status)
        if data is None:
            return self._empty(404)
        if partial and start >= size:
            return self._empty(416, {"Content-Range": f"bytes */{size}"})
        self.send_response(206 if partial else 200)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(end - start))
        if owner.ranges:
            self.send_header("Accept-Ranges", "bytes")
        if partial:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if method == "HEAD":
            return
        if fault is not None and fault.kind == "stall":
            self.wfile.flush()
            owner._closing.wait(MAX_STALL_S)
            return self._cut()
        if fault is not None and fault.kind == "drop":
            self.wfile.write(data[start : fault.at_byte])
            self.wfile.flush()
            owner._closing.wait(fault.pause)
            return self._cut()
        self.wfile.write(data[start:end])

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _cut(self) -> None:
        """Close the connection at once, whatever the headers promised."""
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client may have gone already
            self.connection.shutdown(socket.SHUT_RDWR)
