"""Secrets a client puts in a URL's query string stay out of the real ``vlfit serve`` process's access log, in every
worker of ``--workers 2``: the value of each parameter whose name holds key, token, secret, password or auth (any
case, percent-encoded or not) is logged as ``REDACTED``; other parameters are logged as they came. Every request
has a timeout."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
REQUEST_TIMEOUT = 30
SECRETS = {"key": "secret-value-key-0001", "api%5Fkey": "secret-value-key-0002", "Token": "secret-value-key-0003",
           "client_secret": "secret-value-key-0004", "PASSWORD": "secret-value-key-0005",
           "X-Auth": "secret-value-key-0006"}  # fmt: skip


@pytest.fixture(scope="module")
def index(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory):
    import vlfit

    folder = tmp_path_factory.mktemp("redaction") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(folder), dataset_name=synthetic_dataset_dir, split="validation",
                      index_type="flat")  # fmt: skip
    return folder


def test_query_string_secrets_are_redacted_in_the_access_log_of_every_worker(index, tmp_path) -> None:
    from vlfit.serve.launch import kill_process_tree, start_server

    log = tmp_path / "server.log"
    flags = ["--index", str(index), "--workers", "2", "--reload_interval", "0"]
    server = start_server(flags, str(log), timeout=START_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    query = "&".join(f"{name}={value}" for name, value in SECRETS.items()) + "&k=5&note=kept-as-it-came"
    try:
        # A new connection per request (the kernel hands it to either worker), until both workers have answered.
        pids, requests, deadline = set(), 0, time.monotonic() + START_TIMEOUT
        while len(pids) < 2:
            assert time.monotonic() < deadline, f"one worker answered every connection: {pids}"
            answer = httpx.get(f"{server.url}/api/health?{query}", timeout=REQUEST_TIMEOUT)
            assert answer.status_code == 200, answer.text
            pids.add(answer.json()["pid"])
            requests += 1
        time.sleep(0.5)  # a worker logs a request just after answering it
    finally:
        kill_process_tree(server.process)
    logged = [line for line in log.read_text().splitlines() if "GET /api/health?" in line]
    assert len(logged) == requests  # each request's line, from whichever worker answered it
    for value in SECRETS.values():
        assert value not in log.read_text()
    redacted = "&".join(f"{name}=REDACTED" for name in SECRETS) + "&k=5&note=kept-as-it-came"
    assert all(f"GET /api/health?{redacted} HTTP/1.1" in line for line in logged), logged
