"""The ASGI app of ``vlfit serve`` (FastAPI on uvicorn): search, thumbnails, health, metrics, reload, the web page.

Routes:

- ``POST /api/search``: JSON ``{"text": "...", "k": 10}`` or ``{"image": "<base64>", "k": 10}``, or a multipart
  upload (an image file in the field ``file``, ``k`` as a form field) -> ``{"results": [{"id", "row", "score",
  "item", "path", "caption", "captions"}], "took_ms", "k", "generation"}`` (each result ``Hit.to_json``'s, as
  ``vlfit retrieve query --json`` prints it: ``id`` the item's id, for an image folder its path relative to the
  folder; ``captions``: every caption of an image item, ``caption`` the first);
- ``GET /api/image/{row}?size=256``: the indexed image at ``row`` (a result's ``row``, ASCII digits) as a JPEG
  thumbnail; a file that cannot be shown is 404 or 422 naming the item, never its bytes
  (``vlfit.serve.images.IndexedThumbnails``);
- ``GET /api/health`` (``{"status": "ok", "pid", "workers": {"ready": R, "of": N}, ...}``: the process that answered,
  and how many of the server's N processes accept connections, ``vlfit.serve.readiness``), ``GET /metrics``
  (Prometheus text), ``POST /api/reload`` (serve the index's current manifest if it changed; the server also checks
  every ``reload_interval`` seconds);
- ``GET /``: the web page (``vlfit/serve/static/index.html``, no external assets);
- Weaviate's multi2vec protocol: ``POST /vectorize``, ``GET /meta``, ``GET /.well-known/live`` and ``ready``
  (``vlfit.serve.weaviate``);
- OpenAI's embeddings API: ``POST /v1/embeddings``, ``GET /v1/models`` (``vlfit.serve.openai_api``).

Access (keys, the hosts answered, the bodies taken) is checked first, by ``vlfit.serve.access``. Bad requests are
answered, never fatal: a body over the upload limit gets 413, bytes that are not an image 400 with
the decoder's reason, malformed JSON or a missing field 422, ``k`` outside 1..1000 400; errors are
``{"error": "..."}``. What a request may ask is bounded before anything is computed for it (``ServerLimits``:
texts, image pixels, JSON, multipart: 422 or 400; requests in flight, and a search's expected wait
(``vlfit.serve.admission``): 503 with ``Retry-After``; a body that does not arrive in time: 408), and one query's
failure is its own 500 only, which says nothing of it but a reference the server's log gives with its traceback
(``vlfit.serve.responses``); see ``vlfit.serve.limits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from vlfit.errors import ConfigError, DataError
from vlfit.index.stages import StageTimes
from vlfit.inference.rerank_score import RerankScore
from vlfit.serve.access import AccessControl, AccessPolicy
from vlfit.serve.admission import WaitAdmission
from vlfit.serve.batching import MicroBatcher
from vlfit.serve.clients import ClientShares, held_refusals_that_fit
from vlfit.serve.disconnects import ClientGone, unless_disconnected
from vlfit.serve.engine import MAX_K, SearchEngine, check_k
from vlfit.serve.images import (
    THUMBNAIL_SIZES,
    IndexedThumbnails,
    QueryImageTooLarge,
    ThumbnailCache,
    ThumbnailRefused,
    check_query_pixels,
    yield_to_text_queries,
)
from vlfit.serve.limits import (
    ADMISSION_KEY,
    ADMITTED_PATHS,
    CLIENTS_KEY,
    EXEMPT_PATHS,
    LIMITS_KEY,
    METRICS_KEY,
    ServerLimits,
)
from vlfit.serve.metrics import MEDIA_TYPE as METRICS_MEDIA_TYPE
from vlfit.serve.metrics import ServerMetrics
from vlfit.serve.middleware import HeadAsGet, InFlightLimit, RequestMetrics, UploadLimit, WaitLimit, settle_kind
from vlfit.serve.openai_api import OpenAIErrors, add_openai_routes
from vlfit.serve.queries import ITEM_NUMBER_RULE, Query, SearchQuery, ascii_number, read_query
from vlfit.serve.readiness import WorkerCount
from vlfit.serve.responses import error_response, internal_error
from vlfit.serve.weaviate import add_weaviate_routes

logger = logging.getLogger(__name__)

DEFAULT_MAX_UPLOAD_MB = 20.0
THUMBNAIL_THREADS = 2


def create_app(
    engine: SearchEngine,
    *,
    max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB,
    max_batch: int = 32,
    max_wait_ms: float = 0.0,
    reload_interval: float = 2.0,
    limits: ServerLimits | None = None,
    access: AccessPolicy | None = None,
    workers: WorkerCount | None = None,
) -> FastAPI:
    """The app serving ``engine``.

    Args:
        engine: The model and index.
        max_upload_mb: The largest request body, in MB (413 beyond).
        max_batch: The most text queries embedded together.
        max_wait_ms: How long a batch waits for more text queries after taking those already queued.
        reload_interval: Seconds between checks of the index's manifest (0: only ``POST /api/reload``).
        limits: The server's other bounds (default: ``ServerLimits()``'s).
        access: Keys, hosts and bodies the server takes (``vlfit serve`` always gives one); ``None``: no checks.
        workers: Where this process says it is ready, and counts the ready workers of ``--workers N``
            (``vlfit.serve.readiness``); ``None``: one process.
    """
    limits = limits or ServerLimits()
    workers = workers or WorkerCount()
    metrics = ServerMetrics()

    def run_batch(queries: Sequence[tuple[str, int | None, RerankScore]], k: int) -> list[list[dict[str, object]]]:
        """A batch of (text, rerank, rerank score) queries: embedded together, searched, their re-ranking pairs
        scored together. Each query observes the batch's stage times (the re-ranking time: those that asked for it)."""
        texts, reranks, scores = [list(column) for column in zip(*queries, strict=True)]
        times = StageTimes()
        results = engine.search(engine.encode_texts(texts, times), k, texts, reranks, times, scores)
        spent = times.seconds
        metrics.observe_stages({stage: spent[stage] for stage in spent if stage != "rerank"}, len(queries))
        if "rerank" in spent:
            metrics.observe_stages({"rerank": spent["rerank"]}, sum(1 for rerank in reranks if rerank))
        return results

    batcher = MicroBatcher(run_batch, max_batch=max_batch, max_wait_ms=max_wait_ms, on_batch=metrics.observe_batch)
    budget = limits.max_queue_wait_ms  # None: no wait budget; 0: derived from the unloaded time; else ms
    admission = None if budget is None else WaitAdmission(budget / 1000.0 if budget > 0 else None)
    clients = ClientShares(limits.max_connections_per_client, limits.requests_per_client, limits.forwarded_allow_ips,
                           max_held=held_refusals_that_fit(limits.max_connections),
                           max_uploads=limits.uploads_per_client)  # fmt: skip
    # Image queries decode and embed on a thread of their own, never the text encoder's; thumbnails on a small pool.
    # Both yield the cores to the text queries when both want them (a 40-megapixel PNG decodes for seconds).
    image_queries = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlfit-image-query",
                                       initializer=yield_to_text_queries)  # fmt: skip
    thumbnails = ThreadPoolExecutor(max_workers=THUMBNAIL_THREADS, thread_name_prefix="vlfit-thumbnail",
                                    initializer=yield_to_text_queries)  # fmt: skip
    thumbnail_cache = ThumbnailCache(int(limits.thumbnail_cache_mb * 1e6))
    # Weaviate's vectorizing (bulk imports) on a thread of its own, yielding the cores as the image threads do.
    vectorizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlfit-vectorize",
                                     initializer=yield_to_text_queries)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        poller = asyncio.get_running_loop().create_task(_poll(engine, reload_interval)) if reload_interval > 0 else None
        try:
            workers.started()  # the supervisor of --workers N says the server runs once every worker is here
            # what the server's connections are bounded by, and the searches' admission they refuse by
            yield {LIMITS_KEY: limits, METRICS_KEY: metrics, ADMISSION_KEY: admission, CLIENTS_KEY: clients}
        finally:
            workers.stopped()
            if poller is not None:
                poller.cancel()
            await batcher.close()
            for pool in (image_queries, thumbnails, vectorizing):
                pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="vlfit serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    page = resources.files("vlfit.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def home() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/api/health")
    async def health() -> dict[str, object]:
        """``{"status": "ok", "pid", "workers": {"ready": R, "of": N}, ...}`` and the engine's description: ``pid``
        the process that answered, ``workers`` how many of the N processes of ``--workers N`` have loaded their
        app and accept connections (``{"ready": 1, "of": 1}`` for one process)."""
        return {"status": "ok", "pid": os.getpid(), "workers": workers.read(), **engine.description}

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render(len(engine.snapshot), engine.generation)
        return Response(text, media_type=METRICS_MEDIA_TYPE)

    @app.post("/api/reload")
    async def reload() -> dict[str, object]:
        changed = await asyncio.get_running_loop().run_in_executor(None, engine.reload_if_changed)
        return {"reloaded": changed, **engine.description}

    indexed_thumbnails = IndexedThumbnails()  # answers an item that cannot be shown, and logs it once

    @app.get("/api/image/{item}")
    async def image(request: Request, item: str, size: str = "256") -> Response:
        row = ascii_number(item)  # the path parameter as sent: int() would take "+1", " 1", "1_0"
        if row is None:
            return error_response(404, f"no item {item[:40]!r}: {ITEM_NUMBER_RULE}")
        side = ascii_number(size)  # the query parameter as sent, as strictly
        if side is None:
            low, high = THUMBNAIL_SIZES
            return error_response(400, f"size {size[:40]!r}: a thumbnail's side is ASCII digits, {low} to {high}")
        key = (engine.generation, row, side)
        data = thumbnail_cache.get(key)
        if data is None:
            snapshot = engine.snapshot
            try:
                data = await unless_disconnected(
                    request, thumbnails, lambda: indexed_thumbnails.make(snapshot.indexed, row, side)
                )
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; counted as what it is
            except ThumbnailRefused as err:
                return error_response(err.status, str(err))
            thumbnail_cache.put(key, data)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    @app.post("/api/search")
    async def search(request: Request) -> Response:
        started = time.perf_counter()
        query = await read_query(request, limits.max_text_chars)
        if isinstance(query, Response):
            return query
        try:
            check_k(query.k)
            by = engine.check_rerank(query.rerank, query.rerank_score)
        except ConfigError as err:
            return error_response(400, str(err))
        refused = settle_kind(request.scope, admission, metrics, "text" if query.text is not None else "image")
        if refused is not None:
            return refused
        try:
            if query.text is not None:
                text, k, rerank = query.text, query.k, query.rerank
                results = await unless_disconnected(request, None, lambda: batcher.submit((text, rerank, by), k))
            else:
                image_bytes, k = query.image or b"", query.k

                def image_search() -> list[dict[str, object]]:
                    times = StageTimes()
                    with times.stage("decode"):  # reading the header is part of turning the bytes into pixels
                        check_query_pixels(image_bytes, limits.max_query_pixels)
                    (found,) = engine.search(engine.encode_image(image_bytes, times), k, times=times)
                    metrics.observe_stages(times.seconds)
                    return found

                results = await unless_disconnected(request, image_queries, image_search)
        except ClientGone:
            return Response(status_code=499)
        except QueryImageTooLarge as err:
            return error_response(422, str(err))
        except DataError as err:
            return error_response(400, f"the upload is not an image vlfit can read: {err}")
        except Exception as err:  # noqa: BLE001 - this query's failure, and only this query's (batches retry one by one)
            return internal_error(logger, f"a search ({_describe(query)})", err)
        return JSONResponse({"results": results, "k": query.k, "generation": engine.generation,
                             "took_ms": round(1000 * (time.perf_counter() - started), 3)})  # fmt: skip

    add_weaviate_routes(app, engine, limits=limits, metrics=metrics, pool=vectorizing)
    add_openai_routes(app, engine, limits=limits, metrics=metrics, pool=vectorizing)  # the same thread and queue

    app.add_middleware(HeadAsGet)
    if admission is not None:
        app.add_middleware(WaitLimit, admission=admission, metrics=metrics, paths=ADMITTED_PATHS)
    app.add_middleware(InFlightLimit, max_requests=limits.max_concurrency, clients=clients, metrics=metrics,
                       exempt=EXEMPT_PATHS)  # fmt: skip
    app.add_middleware(UploadLimit, max_bytes=int(max_upload_mb * 1e6), clients=clients, metrics=metrics,
                       timeout=limits.body_timeout)  # bodies arrive before a request takes its slot  # fmt: skip
    if access is not None:
        app.add_middleware(AccessControl, policy=access)  # before any work is done for a request
    app.add_middleware(OpenAIErrors)  # /v1/'s errors in OpenAI's shape, the key's and the limits' too
    app.add_middleware(RequestMetrics, metrics=metrics)  # outermost: counts the 413s and 503s too
    app.state.engine, app.state.batcher, app.state.metrics = engine, batcher, metrics
    app.state.admission = admission
    app.state.limits, app.state.thumbnail_cache = limits, thumbnail_cache
    app.state.image_pools = (image_queries, thumbnails, vectorizing)
    return app


def _describe(query: Query) -> str:
    if query.text is not None:
        return f"text of {len(query.text)} characters: {query.text[:60]!r}"
    return f"image of {len(query.image or b'')} bytes"


async def _poll(engine: SearchEngine, interval: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        try:
            await loop.run_in_executor(None, engine.reload_if_changed)
        except Exception:  # noqa: BLE001 - a failed check must not end the polling; the next one tries again
            logger.exception("checking %s for a new manifest failed", engine.folder)


__all__ = ["MAX_K", "SearchQuery", "create_app"]
