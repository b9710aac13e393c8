"""``vlfit serve --workers N`` from its start: connections refused after the log's ``Uvicorn running on`` line.

A script waits for that line (docs/serving.md: with ``--port 0`` it names the port) and connects: every connection
refused from then on is one the line promised. The server is started with ``--port 0``; from the moment its log
has the line, one loopback connection is opened every ``TRY_EVERY_S`` seconds until ``WATCH_S`` seconds after the
first one accepted, and ``/api/health`` asked every ``HEALTH_EVERY`` tries. Figures: seconds from the start to the
line and to the first connection accepted, tries refused after the line (goal: 0), and what ``/api/health`` said
of the workers.

    python benchmarks/serve_ready.py --index DIR [--model DIR] [--workers 2] [--server_src DIR]

``--server_src`` runs the server from another checkout's ``src`` (PYTHONPATH), to compare two versions. About 30 s
with the tests' index.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

TRY_EVERY_S = 0.01
WATCH_S = 5.0
HEALTH_EVERY = 50
START_TIMEOUT_S = 300.0


def serve_ready(index: str, model: str | None, out: str, workers: int = 2, server_src: str | None = None) -> dict:
    """Start ``vlfit serve --workers WORKERS --port 0`` and count the connections refused after its ready line."""
    from vlfit.serve.launch import kill_process_tree, logged_port

    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, f"ready-server-{workers}.log")
    flags = ["--index", index, "--workers", str(workers), "--port", "0", "--reload_interval", "0"]
    flags += ["--model", model] if model else []
    env = {**os.environ, **({"PYTHONPATH": os.path.abspath(server_src)} if server_src else {})}
    started = time.monotonic()
    with open(log, "w") as f:
        process = subprocess.Popen([sys.executable, "-m", "vlfit", "serve", *flags], stdout=f,
                                   stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        while (port := logged_port(log)) is None:
            if process.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"vlfit serve gave no ready line (exit {process.poll()}); see {log}")
            time.sleep(0.005)
        line_s = time.monotonic() - started
        tries, refused, first_accept_s, healths = 0, 0, None, []
        while first_accept_s is None or time.monotonic() - started < first_accept_s + WATCH_S:
            if time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"vlfit serve accepted no connection in {START_TIMEOUT_S:g} s; see {log}")
            tries += 1
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    first_accept_s = first_accept_s or time.monotonic() - started
            except ConnectionRefusedError:
                refused += 1
            if tries % HEALTH_EVERY == 0 and first_accept_s is not None:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=10) as answer:
                    healths.append(json.load(answer).get("workers"))
            time.sleep(TRY_EVERY_S)
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(60)
    finally:
        kill_process_tree(process)
    return {"workers": workers, "server_src": server_src, "line_s": round(line_s, 2),
            "first_accept_s": None if first_accept_s is None else round(first_accept_s, 2),
            "tries_after_line": tries, "refused_after_line": refused,
            "health_workers": sorted({json.dumps(health) for health in healths}), "exit_code": exit_code}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", required=True, help="An index folder.")
    parser.add_argument("--model", default=None, help="The model the server embeds with (default: the index's).")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/serve-ready")
    parser.add_argument("--server_src", default=None, help="Run the server from this src folder (PYTHONPATH).")
    args = parser.parse_args()
    results = {"load_average": os.getloadavg(),
               **serve_ready(args.index, args.model, args.out, args.workers, args.server_src)}  # fmt: skip
    with open(os.path.join(args.out, "serve_ready.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
