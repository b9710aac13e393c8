"""The real ``vlfit serve`` process on a free loopback port: queried over HTTP, driven from headless Chromium, and
stopped by SIGTERM with a request in flight (answered; exit 0). One server for the module; every request has a
timeout. ``--workers N`` hands its settings to uvicorn's worker processes through the environment (checked
in-process), and one real two-worker start checks that ``/metrics`` counts both workers' requests."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.browser import browser_verdict, find_browser, under_ci

pytestmark = pytest.mark.slow

START_TIMEOUT = 120  # seconds for the process to load the model and bind, far above what it takes
REQUEST_TIMEOUT = 30
HEADER_TIMEOUT = 2  # the module's server lets a connection go this long without a whole request head
MAX_CONNECTIONS = 16
API_KEY = "module-server-key-0123456789"  # the module's server needs it (given through VLFIT_API_KEY, never argv)
KEYED = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(served_index: Path, tmp_path_factory):
    from vlfit.serve.launch import kill_process_tree, start_server

    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = ["--index", str(served_index), "--header_timeout", str(HEADER_TIMEOUT), "--max_connections",
             str(MAX_CONNECTIONS)]  # fmt: skip
    server = start_server(flags, str(log), timeout=START_TIMEOUT,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLFIT_API_KEY": API_KEY})  # fmt: skip
    try:
        yield server.url, server.process, log
    finally:
        kill_process_tree(server.process)  # and anything it started, if a test left it running


def test_the_server_process_answers_over_http_on_loopback(server, train_records) -> None:
    base, _, log = server
    record = train_records[3]
    query = {"text": record.caption, "k": 5}
    assert httpx.post(f"{base}/api/search", json=query, timeout=REQUEST_TIMEOUT).status_code == 401  # no key
    answer = httpx.post(f"{base}/api/search", json=query, headers=KEYED, timeout=REQUEST_TIMEOUT)
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert len(results) == 5 and results[0]["caption"] is not None
    thumb = httpx.get(f"{base}/api/image/{results[0]['row']}?size=96", headers=KEYED, timeout=REQUEST_TIMEOUT)
    assert thumb.status_code == 200 and thumb.content[:2] == b"\xff\xd8"
    assert "127.0.0.1" in log.read_text()  # bound to loopback, as by default
    assert API_KEY not in log.read_text()


def _chrome_driver(tmp_path: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = find_browser()
    verdict, reason = browser_verdict(browser, driver_path, ci=under_ci(os.environ))
    if verdict == "skip":
        pytest.skip(reason)
    if verdict == "fail":
        pytest.fail(reason)
    assert browser is not None and driver_path is not None
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,900"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def test_the_web_page_shows_the_expected_images_for_a_typed_query(server, served_index, train_records, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    import vlfit

    base, _, _ = server
    index = vlfit.Index.open(str(served_index))
    # A caption whose image the model ranks first (the library's exact search says which): the page must show it.
    record = next(r for r in train_records if index.search(r.caption, k=1)[0].id == r.id)
    driver = _chrome_driver(tmp_path)
    try:
        driver.set_page_load_timeout(REQUEST_TIMEOUT)
        driver.get(base + "/")
        WebDriverWait(driver, REQUEST_TIMEOUT).until(
            lambda d: "images in" in d.find_element(By.ID, "about").text
        )  # the page asked /api/health
        box = driver.find_element(By.ID, "query")
        box.clear()
        box.send_keys(record.caption)
        driver.find_element(By.ID, "go").click()
        # The server needs a key: the page asks for it once (and keeps it for the session's later requests).
        prompt = WebDriverWait(driver, REQUEST_TIMEOUT).until(expected_conditions.alert_is_present())
        prompt.send_keys(API_KEY)
        prompt.accept()
        WebDriverWait(driver, REQUEST_TIMEOUT).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "#results figure.hit"))
        )
        hits = driver.find_elements(By.CSS_SELECTOR, "#results figure.hit")
        assert len(hits) == 12  # the page's default k
        assert hits[0].get_attribute("data-item") == record.id
        assert record.caption in hits[0].text
        # The thumbnails really loaded (decoded by the browser, not broken-image icons).
        WebDriverWait(driver, REQUEST_TIMEOUT).until(
            lambda d: all(
                d.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0;", img)
                for img in d.find_elements(By.CSS_SELECTOR, "#results figure.hit img")[:4]
            )  # fmt: skip
        )
    except Exception:
        driver.save_screenshot(str(Path(os.environ.get("VLFIT_SCREENSHOT_DIR", tmp_path)) / "browser-failure.png"))
        raise
    finally:
        driver.quit()


def _post_in_two_parts(port: int, body: bytes) -> socket.socket:
    """A search request on a raw connection with only half its body sent: in flight until the rest is."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT)
    head = "POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"X-API-Key: {API_KEY}\r\n"
    connection.sendall((head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body[: len(body) // 2])
    return connection


def _read_response(connection: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = connection.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in head else 0


def test_connections_heads_and_idle_sockets_are_bounded_and_a_good_query_is_answered_after(server, train_records):
    base, _, log = server
    port = int(base.rsplit(":", 1)[1])

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT)

    with connect() as big:  # 20 KB of headers (uvicorn on httptools took 100 MB): 431, closed
        big.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        assert _read_response(big).startswith(b"HTTP/1.1 431")
    started = time.monotonic()
    with connect() as trickle:  # a head that never ends: 408 after --header_timeout, closed
        trickle.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _read_response(trickle).startswith(b"HTTP/1.1 408")
    assert HEADER_TIMEOUT - 0.5 < time.monotonic() - started < HEADER_TIMEOUT + 5
    # Silent connections, up to the cap: the next one is answered 503 and closed at once; the silent ones are let
    # go after --header_timeout (uvicorn held them forever).
    extra = 3
    opened = [connect() for _ in range(MAX_CONNECTIONS + extra)]  # within milliseconds: all open at once
    started = time.monotonic()
    try:
        # The refusals come at once; on a loaded machine "at once" can take a while: wait for the first (well
        # before --header_timeout lets the silent ones go), then a little for the others.
        while not select.select(opened, [], [], 0.05)[0] and time.monotonic() - started < HEADER_TIMEOUT / 2:
            pass
        time.sleep(0.3)
        answered = [connection for connection in opened if select.select([connection], [], [], 0)[0]]
        refusals = [connection.recv(4096) for connection in answered]
        # Those beyond the cap (a browser's last connections may still be closing: a few more may get in).
        assert 1 <= len(refusals) <= extra and answered == opened[len(opened) - len(answered) :]
        assert all(r.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in r.lower() for r in refusals), refusals
        for connection in opened[: len(opened) - len(answered)]:
            connection.settimeout(HEADER_TIMEOUT + 5)
            assert connection.recv(4096) == b""  # closed by the server, with nothing to answer
        assert time.monotonic() - started < HEADER_TIMEOUT + 5
    finally:
        for connection in opened:
            connection.close()
    answer = httpx.post(f"{base}/api/search", json={"text": train_records[1].caption, "k": 2}, headers=KEYED,
                        timeout=REQUEST_TIMEOUT)  # fmt: skip
    assert answer.status_code == 200 and len(answer.json()["results"]) == 2
    metrics = httpx.get(f"{base}/metrics", headers=KEYED, timeout=REQUEST_TIMEOUT).text
    assert re.search(r'^vlfit_refused_total\{limit="connections"\} [1-9]', metrics, flags=re.M), metrics
    assert f"over the limit of {MAX_CONNECTIONS} open (--max_connections)" in log.read_text()


def test_sigterm_finishes_the_request_in_flight_and_exits_zero(server, train_records) -> None:
    base, process, log = server
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"text": train_records[0].caption, "k": 3}).encode()
    connection = _post_in_two_parts(port, body)
    try:
        time.sleep(0.5)  # the server has the request's head: the request is in flight
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # shutting down, waiting for it
        assert process.poll() is None, "the server exited with a request in flight"
        connection.sendall(body[len(body) // 2 :])
        response = _read_response(connection)
    finally:
        connection.close()
    assert response.startswith(b"HTTP/1.1 200"), response[:300]
    assert len(json.loads(response.split(b"\r\n\r\n", 1)[1])["results"]) == 3
    assert process.wait(timeout=30) == 0, log.read_text()[-3000:]


def test_worker_processes_build_their_app_from_the_settings_in_the_environment(served_index, monkeypatch) -> None:
    """Each worker builds its app from the flags, and hides what the command hides at its --log_level (a worker is a
    process of its own: transformers warned of every SigLIP 2 config's token ids in each one)."""
    import logging

    from fastapi.testclient import TestClient
    from transformers import Siglip2Config

    from tests.test_logging import transformers_messages
    from vlfit.commands.serve import SETTINGS_ENV, ServeArguments, app_from_environment, worker_settings

    monkeypatch.setattr(logging.getLogger("vlfit"), "level", logging.INFO)  # vlfit serve's default --log_level
    settings = ServeArguments(index=str(served_index), workers=2, port=8123, max_batch=3, reload_interval=0)
    monkeypatch.setenv(SETTINGS_ENV, worker_settings(settings, None, {}))
    with transformers_messages() as messages:
        with TestClient(app_from_environment(), base_url="http://127.0.0.1:8123") as client:  # what each worker calls
            health = client.get("/api/health").json()
            assert health["status"] == "ok" and health["index"] == served_index.name
            assert client.app.state.batcher.max_batch == 3
        logging.Logger.warning_once.cache_clear()  # transformers says each warning once per process
        Siglip2Config()
    assert not [message for message in messages if "_token_id must be" in message], messages


def test_a_search_over_its_wait_budget_is_refused_by_its_connection_which_serves_on(served_index, train_records,
                                                                                     tmp_path) -> None:  # fmt: skip
    """With --max_queue_wait_ms, a search that would wait over the budget behind the searches already whole and not
    yet answered is answered 503 by its connection as soon as its head is read: the app never sees it (refused, not
    among the requests answered), its body is dropped, and the same keep-alive connection is served on."""
    from vlfit.serve.launch import kill_process_tree, start_server

    flags = ["--index", str(served_index), "--reload_interval", "0", "--max_queue_wait_ms", "0.001"]
    server = start_server(flags, str(tmp_path / "server.log"), timeout=START_TIMEOUT,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    base, port = server.url, server.port
    try:
        body = json.dumps({"text": train_records[1].caption, "k": 2}).encode()
        # Nothing ahead: admitted whatever the budget, and timed (the time per query ahead the budget is held to).
        assert httpx.post(f"{base}/api/search", content=body, headers={"Content-Type": "application/json"},
                          timeout=REQUEST_TIMEOUT).status_code == 200  # fmt: skip
        # 16 whole searches sent at once: the first is admitted, those read while it is pending wait over 1 us.
        head = b"POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        request = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        connections = [socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) for _ in range(16)]
        try:
            for connection in connections:
                connection.sendall(request)
            answers = [_read_response(connection) for connection in connections]
            refused = [n for n, answer in enumerate(answers) if answer.startswith(b"HTTP/1.1 503")]
            assert answers[0].startswith(b"HTTP/1.1 200") and refused, [answer[:12] for answer in answers]
            assert all(answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")) for answer in answers)
            answer = answers[refused[0]]
            assert b"retry-after: 1" in answer.lower() and b"over the budget of" in answer, answer
            assert b"connection: close" not in answer.lower()
            connections[refused[0]].sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # served on
            assert _read_response(connections[refused[0]]).startswith(b"HTTP/1.1 200")
        finally:
            for connection in connections:
                connection.close()
        metrics = httpx.get(f"{base}/metrics", timeout=REQUEST_TIMEOUT).text
        assert re.search(rf'^vlfit_refused_total\{{limit="wait"\}} {len(refused)}\.0$', metrics, flags=re.M), metrics
        assert not re.search(r'^vlfit_requests_total\{route="/api/search",status="503"\}', metrics, flags=re.M)
        assert _requests_counted(metrics, "/api/search") == 1 + 16 - len(refused)
    finally:
        kill_process_tree(server.process)


# Query-string parameters whose names hold key, token, secret, password or auth (any case, percent-encoded or not).
SECRETS = {"key": "secret-value-key-0001", "api%5Fkey": "secret-value-key-0002", "Token": "secret-value-key-0003",
           "client_secret": "secret-value-key-0004", "PASSWORD": "secret-value-key-0005",
           "X-Auth": "secret-value-key-0006"}  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
def test_keys_stay_out_of_every_environment_and_a_workers_key_file_goes_with_the_server(
    served_index, tmp_path, workers
) -> None:
    """The API key from --api_key_file, the admin key from $VLFIT_ADMIN_KEY (so in the environment the server was
    started with, and no other): no process of the server holds a key in its environment; the workers read the
    keys from a private file, gone once the server stops. And the index is checked once per start (--verify full),
    by the parent, not again by each worker. With ``--workers 2`` (the same server: fewer starts for the suite),
    also: ``/metrics`` counts the requests of every worker, their shared counts' folder goes with the server, and
    secrets in a URL's query string are logged as ``REDACTED`` by every worker, other parameters as they came."""
    import psutil

    from vlfit.commands.serve import SETTINGS_ENV
    from vlfit.serve.launch import kill_process_tree, start_server

    api_key, admin_key = "api-key-in-a-file-0123456789", "admin-key-in-the-environment-0123456789"
    (tmp_path / "api_key.txt").write_text(api_key + "\n")
    flags = ["--index", str(served_index), "--workers", str(workers), "--reload_interval", "0",
             "--api_key_file", str(tmp_path / "api_key.txt")]  # fmt: skip
    (tmp_path / "sitecustomize.py").write_text(COUNT_CHECKS)
    checks = tmp_path / "checks.txt"
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLFIT_ADMIN_KEY": admin_key,
           "VLFIT_TEST_CHECKS": str(checks),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    flags += ["--verify", "full"]
    log = tmp_path / "server.log"
    server = start_server(flags, str(log), timeout=START_TIMEOUT, env=env)
    base, process = server.url, server.process
    keyed = {"Authorization": f"Bearer {api_key}"}
    secrets = "&".join(f"{name}={value}" for name, value in SECRETS.items()) + "&k=5&note=kept-as-it-came"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while log.read_text().count("Application startup complete") < workers:  # every worker has read its keys
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        assert checks.read_text().split() == [str(process.pid)]  # by the parent, not again by each worker
        # A new connection per page request (the kernel hands it to either worker), until every worker has
        # answered some; /api/health on the same connection says which worker holds it.
        pids, pages = set(), 0
        while len(pids) < workers or pages < 6:
            assert time.monotonic() < deadline, f"one worker answered every connection: {pids}"
            with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT) as client:
                pids.add(client.get(f"/api/health?{secrets}").json()["pid"])
                assert client.get("/").status_code == 200
                pages += 1
        query = {"text": "a red circle", "k": 2}
        for _ in range(2 * workers):  # new connections: either worker may answer
            assert (
                httpx.post(f"{base}/api/search", json=query, headers=keyed, timeout=REQUEST_TIMEOUT).status_code == 200
            )
            assert httpx.post(f"{base}/api/search", json=query, timeout=REQUEST_TIMEOUT).status_code == 401
        time.sleep(0.5)  # a worker counts and logs a request just after answering it
        for _ in range(2 * workers):  # new connections: whichever worker answers counts the other's requests too
            metrics = httpx.get(f"{base}/metrics", headers=keyed, timeout=REQUEST_TIMEOUT).text
            assert _requests_counted(metrics, "/") == pages
        # The admin key is in the environment the server was started with; nothing may add either key to one.
        assert api_key.encode() not in Path(f"/proc/{process.pid}/environ").read_bytes()
        children = psutil.Process(process.pid).children(recursive=True)
        assert workers == 1 or len(children) >= workers  # uvicorn's workers (and what they start)
        for child in children:
            environment = Path(f"/proc/{child.pid}/environ").read_bytes()
            assert api_key.encode() not in environment and admin_key.encode() not in environment, child.cmdline()
        given = [json.loads(child.environ()[SETTINGS_ENV])["flags"] for child in children
                 if SETTINGS_ENV in child.environ()]  # fmt: skip
        files = {given_flags[name] for given_flags in given for name in ("api_key_file", "admin_key_file")}
        assert len(files) == 2 * (workers > 1)  # one file per key, the same for every worker
        folders = {os.path.dirname(file) for file in files}
        assert all(os.stat(file).st_mode & 0o777 == 0o600 for file in files)
        assert all(os.stat(folder).st_mode & 0o777 == 0o700 for folder in folders)
        counts = {psutil.Process(child.pid).environ().get("PROMETHEUS_MULTIPROC_DIR") for child in children} - {None}
        assert len(counts) == (workers > 1) and all(os.path.isdir(folder) for folder in counts)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert not any(os.path.exists(folder) for folder in folders | counts)  # the keys' and counts' folders go
    finally:
        kill_process_tree(process)
    logged = [line for line in log.read_text().splitlines() if "GET /api/health?" in line]
    assert len(logged) == pages  # each request's line, from whichever worker answered it
    assert not any(value in log.read_text() for value in SECRETS.values())
    redacted = "&".join(f"{name}=REDACTED" for name in SECRETS) + "&k=5&note=kept-as-it-came"
    assert all(f"GET /api/health?{redacted} HTTP/1.1" in line for line in logged), logged


def _requests_counted(text: str, route: str) -> float:
    pattern = rf'^vlfit_requests_total{{route="{re.escape(route)}",status="200"}} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, flags=re.M))


# Imported first by every Python process of the server (PYTHONPATH): one line, the process's pid, per check of the
# index against its manifest (vlfit.index.verify.verify_index, wrapped as the module loads).
COUNT_CHECKS = """
import importlib.machinery, os, sys

class CountChecks:
    def find_spec(self, name, path, target=None):
        if name != "vlfit.index.verify":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            check = module.verify_index

            def verify_index(*args, **kwargs):
                with open(os.environ["VLFIT_TEST_CHECKS"], "a") as log:
                    log.write(f"{os.getpid()}\\n")
                return check(*args, **kwargs)

            module.verify_index = verify_index

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, CountChecks())
"""


def test_a_busy_port_or_a_foreign_host_is_refused_in_one_line_before_anything_loads(tmp_path, capsys) -> None:
    from vlfit.cli import main

    never_read = tmp_path / "never-read"  # looks like an index folder (checked before the port), never opened
    never_read.mkdir()
    (never_read / "index_manifest.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--index", str(never_read), "--port", str(port)]) == 2
        assert time.monotonic() - started < 5  # nothing loaded: uvicorn's [Errno 98] came after the model
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"--port {port}: 127.0.0.1:{port} is in use by another process; stop it or choose "
                            "another --port (0: any free one)") and len(err) == 1  # fmt: skip
    assert main(["serve", "--index", str(never_read), "--host", "192.0.2.1", "--port", "0"]) == 2
    assert "--host 192.0.2.1: cannot bind 192.0.2.1:0" in capsys.readouterr().err
