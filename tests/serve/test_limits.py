"""No request hurts another, and everything is bounded, in-process (the real app and engine on a tiny model):
checks before batching, one failing query alone failing, disconnected clients never computed, image and thumbnail
decodes bounded, 503 beyond the requests in flight, strict JSON and multipart, HEAD. Each bad request is followed
by a good query that must be answered. What uvicorn's connections do is tested on the real process
(test_server.py)."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import vlfit
from vlfit.serve.app import create_app
from vlfit.serve.engine import SearchEngine
from vlfit.serve.images import IMAGE_THREAD_NICENESS, ThumbnailCache, thumbnail
from vlfit.serve.limits import ServerLimits

# Room for a test's burst of one client's queries at once, whatever the machine's default (4 per core).
ROOM_FOR_32 = ServerLimits(max_concurrency=32, max_concurrency_per_client=32)


@pytest.fixture(scope="module")
def tiny_index(tiny_checkpoint: Path, synthetic_dataset_dir: str, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(path), dataset_name=synthetic_dataset_dir, split="validation")
    return path


class RecordingEngine(SearchEngine):
    """The real engine, recording what it embeds and on which thread; ``hold`` makes text batches wait."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.embedded: list[str] = []
        self.image_threads: list[str] = []
        self.hold = threading.Event()
        self.hold.set()

    def encode_texts(self, texts, times=None):
        assert self.hold.wait(30)
        self.embedded.extend(texts)
        return super().encode_texts(texts, times)

    def encode_image(self, image, times=None):
        self.image_threads.append(threading.current_thread().name)
        return super().encode_image(image, times)


@pytest.fixture(scope="module")
def engine(tiny_index: Path) -> RecordingEngine:
    return RecordingEngine(str(tiny_index))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, reload_interval=0)) as test_client:
        yield test_client


def _in_event_loop(test):
    """Run an async test function in a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def _good_query_still_works(client) -> None:
    answer = client.post("/api/search", json={"text": "one red circle", "k": 3})
    assert answer.status_code == 200 and len(answer.json()["results"]) == 3


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")  # 1 bit per pixel, all zero: compresses to little
    return out.getvalue()


def _jpeg(width: int, height: int, orientation: int | None = None) -> bytes:
    picture = Image.new("RGB", (width, height), (200, 30, 30))
    picture.paste((20, 20, 220), (0, 0, width // 4, height))  # a blue band on the left
    out = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    picture.save(out, format="JPEG", quality=80, exif=exif.tobytes())
    return out.getvalue()


async def _asgi_post(app, body: bytes, *, disconnect_after: float | None = None) -> tuple[int | None, list[dict]]:
    """POST ``body`` to /api/search straight through ASGI; after the body, the client disconnects
    ``disconnect_after`` seconds later (``None``: never). Returns the status sent (None: no answer) and every
    message sent."""
    body_sent = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600 if disconnect_after is None else disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/api/search", "raw_path": b"/api/search", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 30)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    return (starts[0]["status"] if starts else None), sent


# --- texts: checked before they join a batch -------------------------------------------------------------------


def test_a_lone_surrogate_fails_alone_while_the_queries_batched_with_it_are_answered(engine) -> None:
    bad = b'{"text": "x \\ud800 y", "k": 3}'  # valid JSON, not valid Unicode: no tokenizer takes it

    async def run() -> list[httpx.Response]:
        app = create_app(engine, reload_interval=0, max_wait_ms=50, limits=ROOM_FOR_32)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                good = [http.post("/api/search", json={"text": f"{n} red circles", "k": 3}) for n in range(15)]
                return await asyncio.gather(
                    *good[:7], http.post("/api/search", content=bad, headers={"content-type": "application/json"}),
                    *good[7:]
                )  # fmt: skip

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 7 + [422] + [200] * 8
    assert "not valid Unicode text" in answers[7].json()["error"] and "at character 2" in answers[7].json()["error"]


def test_a_text_over_max_text_chars_is_refused_naming_the_limit(client, engine) -> None:
    before = len(engine.embedded)
    answer = client.post("/api/search", json={"text": "circle " * 1000, "k": 3})  # 7000 characters
    assert answer.status_code == 422
    assert answer.json()["error"] == '"text" is 7000 characters, over the limit of 2000 (--max_text_chars)'
    assert len(engine.embedded) == before  # never reached the encoder
    _good_query_still_works(client)


PRIVATE_PATH = "/srv/models/private-run/text_encoder.onnx"  # what a failure's text may hold and no answer shows


def assert_internal_error(answer: httpx.Response, caplog: pytest.LogCaptureFixture) -> None:
    """``answer`` is a 500 that says nothing of its failure (raised with ``PRIVATE_PATH`` in its text) but a
    reference, under which the server's log holds the failure with its traceback."""
    assert answer.status_code == 500
    error = answer.json()["error"]
    found = re.fullmatch(r"internal error ([0-9a-f]{8}): the server's log has its details under that reference", error)
    assert found is not None, error
    logged = [record for record in caplog.records if found.group(1) in record.getMessage()]
    assert len(logged) == 1 and logged[0].levelname == "ERROR" and logged[0].exc_info is not None
    assert PRIVATE_PATH in str(logged[0].exc_info[1]) and "Traceback" in caplog.text


@_in_event_loop
async def test_a_batch_that_fails_is_retried_one_by_one_and_only_the_failing_query_gets_500(engine, caplog) -> None:
    failing = "this caption breaks the encoder"

    class Breaking(RecordingEngine):
        def encode_texts(self, texts, times=None):
            if failing in texts:
                raise RuntimeError(f"the tokenizer broke reading {PRIVATE_PATH}")
            return super().encode_texts(texts, times)

    breaking = Breaking.__new__(Breaking)
    breaking.__dict__.update(engine.__dict__)
    app = create_app(breaking, reload_interval=0, max_wait_ms=50, limits=ROOM_FOR_32)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            texts = [f"{n} blue squares" for n in range(5)] + [failing] + [f"{n} red circles" for n in range(5)]
            answers = await asyncio.gather(*(http.post("/api/search", json={"text": t, "k": 2}) for t in texts))
            metrics = (await http.get("/metrics")).text
    assert [a.status_code for a in answers] == [200] * 5 + [500] + [200] * 5
    assert_internal_error(answers[5], caplog)
    assert 'vlfit_requests_total{route="/api/search",status="500"} 1.0' in metrics


@_in_event_loop
async def test_a_query_whose_client_disconnected_is_never_computed(engine) -> None:
    app = create_app(engine, reload_interval=0)
    async with app.router.lifespan_context(app):
        engine.hold.clear()  # the encoder is busy: queries queue
        try:
            blocker = asyncio.ensure_future(_asgi_post(app, b'{"text": "the first query", "k": 1}'))
            await asyncio.sleep(0.2)
            queued = b'{"text": "a query its client left while queued", "k": 1}'
            status_queued, _ = await _asgi_post(app, queued, disconnect_after=0.3)
            gone = b'{"text": "a query whose client had left", "k": 1}'
            status_gone, _ = await _asgi_post(app, gone, disconnect_after=0)  # gone by the time it is read
        finally:
            engine.hold.set()
        assert (await blocker)[0] == 200
        status_late, _ = await _asgi_post(app, b'{"text": "a query still waited for", "k": 1}')
    assert status_queued in (None, 499) and status_gone in (None, 499) and status_late == 200
    assert "a query its client left while queued" not in engine.embedded
    assert "a query whose client had left" not in engine.embedded and "a query still waited for" in engine.embedded


@_in_event_loop
async def test_whether_a_client_is_gone_is_asked_of_its_connection_where_it_can_say() -> None:
    """vlfit's connection protocol puts a function in the scope that says whether the request's client is gone;
    that is the answer, and the request's receive (an anyio cancel scope per search) is not called. Without it,
    Starlette's check reads the receive."""
    from starlette.requests import Request

    from vlfit.serve.disconnects import CLIENT_GONE_KEY, client_gone

    async def not_to_be_called():
        raise AssertionError("received although the connection said")

    async def disconnect():
        return {"type": "http.disconnect"}

    for said in (True, False):
        request = Request({"type": "http", CLIENT_GONE_KEY: lambda said=said: said}, receive=not_to_be_called)
        assert await client_gone(request) is said
    assert await client_gone(Request({"type": "http"}, receive=disconnect)) is True


# --- images: bounded before they are decoded ---------------------------------------------------------------------


def test_an_image_declaring_more_than_max_query_pixels_is_refused_from_its_header(client, engine) -> None:
    bomb = _png(13000, 13000)  # 169 megapixels declared, a few KB sent: under the training bomb limit
    assert len(bomb) < 100_000
    started = time.perf_counter()
    answer = client.post("/api/search", files={"file": ("big.png", bomb, "image/png")}, data={"k": "3"})
    assert time.perf_counter() - started < 2  # refused from the header, never decoded (3.7 s and 1.1 GB if it were)
    assert answer.status_code == 422
    assert answer.json()["error"] == (
        "the image is 13000x13000 (169.0 megapixels), over the query limit of 40 megapixels (--max_query_pixels)"
    )
    _good_query_still_works(client)


def test_an_image_refused_from_its_header_draws_no_pillow_warning() -> None:
    """Pillow warns of a decompression bomb from 89.5 megapixels: for an upload the server refuses anyway, that
    warning was the log's only other line."""
    import warnings

    from vlfit.serve.images import QueryImageTooLarge, check_query_pixels

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(QueryImageTooLarge):
            check_query_pixels(_png(13000, 13000), 40_000_000)
    assert [str(w.message) for w in caught if issubclass(w.category, Image.DecompressionBombWarning)] == []


def test_image_queries_run_on_their_own_thread_not_the_text_encoders(client, engine) -> None:
    answer = client.post("/api/search", files={"file": ("q.jpg", _jpeg(320, 240), "image/jpeg")}, data={"k": "2"})
    assert answer.status_code == 200 and len(answer.json()["results"]) == 2
    assert engine.image_threads and engine.image_threads[-1].startswith("vlfit-image-query")
    _good_query_still_works(client)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread niceness is a POSIX call")
def test_the_threads_decoding_images_run_below_the_text_queries_priority(client) -> None:
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    for pool in client.app.state.image_pools:
        assert pool.submit(niceness).result(timeout=10) == min(niceness() + IMAGE_THREAD_NICENESS, 19)


def test_a_thumbnail_is_decoded_at_a_reduced_scale_before_its_exif_rotation(monkeypatch) -> None:
    from PIL import ImageOps

    seen: list[tuple[int, int]] = []
    rotate = ImageOps.exif_transpose

    def spying(image, **kwargs):
        seen.append(image.size)  # what draft left of it: the decode happens at this size
        return rotate(image, **kwargs)

    monkeypatch.setattr(ImageOps, "exif_transpose", spying)
    data = thumbnail(_jpeg(4000, 2000, orientation=6), 64)  # 6: rotate 90 degrees to show
    assert seen and max(seen[0]) <= 4000 // 8 + 8  # DCT-scaled to 1/8 while read, not 4000x2000
    shown = Image.open(io.BytesIO(data))
    assert shown.size == (32, 64)  # rotated: tall, longer side 64
    left_top = shown.convert("RGB").getpixel((16, 2))
    assert left_top[2] > 150 and left_top[0] < 100  # the blue band, rotated from the left to the top


def test_thumbnails_are_cached_by_bytes_and_the_cache_drops_the_least_recent(client) -> None:
    cache: ThumbnailCache = client.app.state.thumbnail_cache
    first = client.get("/api/image/0?size=48")
    hits = cache.hits
    again = client.get("/api/image/0?size=48")
    assert first.status_code == again.status_code == 200 and first.content == again.content
    assert cache.hits == hits + 1
    small = ThumbnailCache(max_bytes=10, max_item_bytes=6)
    small.put((1, 1, 1), b"abcd")
    small.put((1, 2, 1), b"efgh")  # 8 bytes held
    small.put((1, 3, 1), b"toolarge")  # over max_item_bytes: not held
    assert small.get((1, 1, 1)) == b"abcd"  # now the most recent
    small.put((1, 4, 1), b"ijkl")  # 12 > 10: the least recent (1, 2, 1) goes
    assert small.get((1, 2, 1)) is None and small.get((1, 3, 1)) is None and small.held == 8


# --- requests in flight ------------------------------------------------------------------------------------------


@_in_event_loop
async def test_beyond_max_concurrency_a_request_gets_503_with_retry_after_and_is_counted(engine) -> None:
    app = create_app(engine, reload_interval=0, limits=ServerLimits(max_concurrency=2, max_concurrency_per_client=2))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            engine.hold.clear()
            try:
                held = [asyncio.ensure_future(http.post("/api/search", json={"text": f"{n} circles", "k": 1}))
                        for n in range(2)]  # fmt: skip
                await asyncio.sleep(0.2)
                refused = await http.post("/api/search", json={"text": "one more", "k": 1})
                health = await http.get("/api/health")  # never refused: a monitor sees the server up
            finally:
                engine.hold.set()
            assert [answer.status_code for answer in await asyncio.gather(*held)] == [200, 200]
            after = await http.post("/api/search", json={"text": "one red circle", "k": 1})
            metrics = (await http.get("/metrics")).text
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "limit of 2 requests (--max_concurrency)" in refused.json()["error"]
    assert health.status_code == 200 and after.status_code == 200
    assert 'vlfit_refused_total{limit="requests"} 1.0' in metrics


@_in_event_loop
async def test_a_body_that_does_not_arrive_in_time_gets_408(engine) -> None:
    app = create_app(engine, reload_interval=0, limits=ServerLimits(body_timeout=0.3))
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": b'{"text": ', "more_body": True}
        await asyncio.sleep(60)  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/api/search", "raw_path": b"/api/search", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}  # fmt: skip
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), 10)
    (start,) = [m for m in sent if m.get("type") == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m.get("type") == "http.response.body")
    assert start["status"] == 408 and b"within 0.3 s (--body_timeout)" in body


# --- strict requests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"text": "a", "text": "b"}', 422, "the key 'text' appears more than once"),
        (b'{"text": "a", "k": 3, "k": 4}', 422, "the key 'k' appears more than once"),
        (b"[" * 100_000 + b"]" * 100_000, 422, "nests deeper than 8 levels"),
        (b'{"text": "a", "k": ' + b"[" * 20 + b"]" * 20 + b"}", 422, "nests deeper than 8 levels"),
        (b'{"text": "a", "k": true}', 422, "k: Input should be a valid integer"),
        (b'{"text": "a", "k": "5"}', 422, "k: Input should be a valid integer"),
        (b'{"text": "a", "k": 5.0}', 422, "k: Input should be a valid integer"),
        (b'{"text": "a", "k": 5.5}', 422, "k: Input should be a valid integer"),
    ],
    ids=["duplicate-text", "duplicate-k", "nested-100000", "nested-20", "k-bool", "k-string", "k-float", "k-fraction"],
)
def test_json_that_is_ambiguous_nested_or_loosely_typed_gets_422(client, body, status, says) -> None:
    answer = client.post("/api/search", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]
    _good_query_still_works(client)


def test_multipart_with_more_than_one_file_or_a_loose_k_is_refused(client) -> None:
    image = _jpeg(64, 64)
    two = client.post("/api/search", files=[("file", ("a.jpg", image, "image/jpeg")),
                                            ("file", ("b.jpg", image, "image/jpeg"))])  # fmt: skip
    assert two.status_code == 400 and "one image file in the field 'file'" in two.json()["error"]
    other = client.post("/api/search", files=[("file", ("a.jpg", image, "image/jpeg")),
                                              ("extra", ("b.jpg", image, "image/jpeg"))])  # fmt: skip
    assert other.status_code == 400
    for k in ("5.0", "true", "3_0", " 3"):
        loose = client.post("/api/search", files={"file": ("a.jpg", image, "image/jpeg")}, data={"k": k})
        assert loose.status_code == 422 and "k must be an integer" in loose.json()["error"], k
    one = client.post("/api/search", files={"file": ("a.jpg", image, "image/jpeg")}, data={"k": "2"})
    assert one.status_code == 200 and len(one.json()["results"]) == 2
    _good_query_still_works(client)


def test_head_is_answered_wherever_get_is(client) -> None:
    for path in ("/", "/api/health", "/metrics", "/api/image/0?size=32"):
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], path
    assert client.head("/api/search").status_code == 405
    metrics = client.get("/metrics").text
    assert 'vlfit_requests_total{route="/",status="200"}' in metrics  # HEAD counted on its GET route
    _good_query_still_works(client)


def test_limits_out_of_range_are_refused_naming_the_flag() -> None:
    from vlfit.commands.serve import ServeArguments
    from vlfit.errors import ConfigError

    with pytest.raises(ConfigError, match="--max_concurrency must be at least 1, got 0"):
        ServeArguments(index="x", max_concurrency=0)
    with pytest.raises(ConfigError, match="--header_timeout must be positive"):
        ServeArguments(index="x", header_timeout=0)
    assert ServeArguments(index="x").num_threads == 1  # one intra-op thread: the batcher makes the concurrency
    assert ServeArguments(index="x", max_text_chars=50).limits().max_text_chars == 50


def test_requests_in_flight_default_to_four_per_core_the_process_may_use(monkeypatch) -> None:
    from vlfit.serve import limits
    from vlfit.serve.limits import ServerLimits, default_concurrency

    assert [default_concurrency(cores) for cores in (1, 2, 3, 16)] == [8, 8, 12, 64]
    monkeypatch.setattr(limits, "available_cores", lambda: 6)  # the affinity mask a container gives
    assert ServerLimits().max_concurrency == 24 and ServerLimits().requests_per_client == 12
    assert ServerLimits(max_concurrency=5).requests_per_client == 2  # given: kept as given


def test_the_json_parser_bounds_depth_without_recursion() -> None:
    from vlfit.serve.json_body import parse_json

    assert parse_json(b'{"text": "a", "k": 3}') == {"text": "a", "k": 3}
    assert parse_json(json.dumps([[[[1]]]]).encode()) == [[[[1]]]]
    with pytest.raises(ValueError, match="more than once"):
        parse_json(b'{"a": {"b": 1, "b": 2}}')
