"""The ASGI app of ``vlfit serve`` (FastAPI on uvicorn): search, thumbnails, health, metrics, reload, the web page.

Routes:

- ``POST /api/search``: JSON ``{"text": "...", "k": 10}`` or ``{"image": "<base64>", "k": 10}``, or a multipart
  upload (an image file in the field ``file``, ``k`` as a form field) -> ``{"results": [{"id", "score", "item",
  "path", "caption", "captions"}], "took_ms", "k", "generation"}`` (``captions``: every caption of an image item,
  ``caption`` the first);
- ``GET /api/image/{id}?size=256``: the indexed image ``id`` (a result's ``id``) as a JPEG thumbnail;
- ``GET /api/health``, ``GET /metrics`` (Prometheus text), ``POST /api/reload`` (serve the index's current manifest
  if it changed; the server also checks every ``reload_interval`` seconds);
- ``GET /``: the web page (``vlfit/serve/static/index.html``, no external assets).

Bad requests are answered, never fatal: a body over the upload limit gets 413, bytes that are not an image 400 with
the decoder's reason, malformed JSON or a missing field 422, ``k`` outside 1..1000 400; errors are
``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.serve.batching import MicroBatcher
from vlfit.serve.engine import MAX_K, SearchEngine, check_k, thumbnail
from vlfit.serve.metrics import MEDIA_TYPE as METRICS_MEDIA_TYPE
from vlfit.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_UPLOAD_MB = 20.0


class SearchQuery(BaseModel):
    """A JSON search request: exactly one of ``text`` and ``image`` (base64 of the encoded image bytes)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    image: str | None = None
    k: int = 10


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class UploadLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before the app sees it.

    A declared ``Content-Length`` over the limit is refused at once; a body without one (chunked) is read up to the
    limit and refused when it goes beyond. An accepted body is handed to the app as it was received.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        megabytes = self.max_bytes / 1e6
        response = _error(413, f"the request body is over the upload limit of {megabytes:g} MB (--max_upload_mb)")
        await response(scope, receive, send)


class RequestMetrics:
    """ASGI middleware: counts every request and its latency by route template and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def recording_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe_request(route, status, time.perf_counter() - started)


def create_app(
    engine: SearchEngine,
    *,
    max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB,
    max_batch: int = 32,
    max_wait_ms: float = 0.0,
    reload_interval: float = 2.0,
) -> FastAPI:
    """The app serving ``engine``.

    Args:
        engine: The model and index.
        max_upload_mb: The largest request body, in MB (413 beyond).
        max_batch: The most text queries embedded together.
        max_wait_ms: How long a batch waits for more text queries after taking those already queued.
        reload_interval: Seconds between checks of the index's manifest (0: only ``POST /api/reload``).
    """
    metrics = ServerMetrics()

    def run_batch(texts: Sequence[str], k: int) -> list[list[dict[str, object]]]:
        return engine.search(engine.embed_texts(texts), k)

    batcher = MicroBatcher(run_batch, max_batch=max_batch, max_wait_ms=max_wait_ms, on_batch=metrics.observe_batch)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.get_running_loop().create_task(_poll(engine, reload_interval)) if reload_interval > 0 else None
        try:
            yield
        finally:
            if poller is not None:
                poller.cancel()
            await batcher.close()

    app = FastAPI(title="vlfit serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    page = resources.files("vlfit.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def home() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/api/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "pid": os.getpid(), **engine.description}  # pid: which worker process answered

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render(len(engine.snapshot), engine.generation)
        return Response(text, media_type=METRICS_MEDIA_TYPE)

    @app.post("/api/reload")
    async def reload() -> dict[str, object]:
        changed = await asyncio.get_running_loop().run_in_executor(None, engine.reload_if_changed)
        return {"reloaded": changed, **engine.description}

    @app.get("/api/image/{item}")
    def image(item: int, size: int = 256) -> Response:
        snapshot = engine.snapshot
        try:
            data = thumbnail(snapshot.image_bytes(item), size)
        except MissingFileError as err:
            return _error(404, str(err))
        except ConfigError as err:
            return _error(400, str(err))
        except DataError as err:
            return _error(500, str(err))
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    @app.post("/api/search")
    async def search(request: Request) -> Response:
        started = time.perf_counter()
        query = await _read_query(request)
        if isinstance(query, Response):
            return query
        text, image_bytes, k = query
        try:
            check_k(k)
        except ConfigError as err:
            return _error(400, str(err))
        if text is not None:
            results = await batcher.submit(text, k)
        else:
            loop = asyncio.get_running_loop()
            try:
                embedding = await loop.run_in_executor(batcher.executor, engine.embed_image, image_bytes)
            except DataError as err:
                return _error(400, f"the upload is not an image vlfit can read: {err}")
            (results,) = await loop.run_in_executor(batcher.executor, engine.search, embedding, k)
        return JSONResponse({"results": results, "k": k, "generation": engine.generation,
                             "took_ms": round(1000 * (time.perf_counter() - started), 3)})  # fmt: skip

    app.add_middleware(UploadLimit, max_bytes=int(max_upload_mb * 1e6))
    app.add_middleware(RequestMetrics, metrics=metrics)  # outermost: counts the 413s too
    app.state.engine, app.state.batcher, app.state.metrics = engine, batcher, metrics
    return app


async def _read_query(request: Request) -> tuple[str | None, bytes | None, int] | Response:
    """``(text, image bytes, k)`` of a search request, or the error response it gets."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            return _error(422, "a multipart search needs the image file in the field 'file'")
        raw_k = form.get("k", "10")
        try:
            k = int(str(raw_k))
        except ValueError:
            return _error(422, f"k must be an integer, got {raw_k!r}")
        return None, await upload.read(), k
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as err:
        return _error(422, f'the request body is not valid JSON ({err}); send {{"text": "...", "k": 10}}')
    try:
        query = SearchQuery.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
        return _error(422, f"invalid search request: {problems}")
    if (query.text is None) == (query.image is None):
        return _error(422, 'a search takes exactly one of "text" and "image" (base64 of the image file)')
    if query.text is not None:
        if not query.text.strip():
            return _error(422, '"text" is empty')
        return query.text, None, query.k
    try:
        image = base64.b64decode(query.image or "", validate=True)
    except (binascii.Error, ValueError) as err:
        return _error(400, f'"image" is not base64 ({err}): send the image file\'s bytes base64-encoded')
    return None, image, query.k


async def _poll(engine: SearchEngine, interval: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        try:
            await loop.run_in_executor(None, engine.reload_if_changed)
        except Exception:  # noqa: BLE001 - a failed check must not end the polling; the next one tries again
            logger.exception("checking %s for a new manifest failed", engine.folder)


__all__ = ["MAX_K", "SearchQuery", "create_app"]
