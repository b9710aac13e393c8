"""OpenAI's embeddings API on ``vlfit serve``: stacks that speak it (the ``openai`` client, LangChain, LlamaIndex,
gateways) embed texts, and images as Jina's embeddings API sends them, with the served model.

- ``POST /v1/embeddings`` ``{"model": NAME, "input": ...}``: ``input`` a string, or a list of strings, ``{"text":
  "..."}`` and ``{"image": "<base64 or data: URL>"}`` items (Jina's form), mixed -> ``{"object": "list", "data":
  [{"object": "embedding", "index": i, "embedding": [...]}], "model": NAME, "usage": {"prompt_tokens",
  "total_tokens"}}``, one L2-normalized vector per item, in order, the model's own (``vlfit.load(model)``'s
  ``encode_texts`` / ``encode_images``: the same calls as Weaviate's ``/vectorize``, ``vlfit.serve.weaviate``).
  ``encoding_format`` ``float`` (the default) or ``base64`` (little-endian float32, as OpenAI's; the ``openai``
  client asks for it unless told otherwise); ``dimensions`` 1 to the served size: each embedding's first that many
  dimensions, normalised again (``vlfit.inference.embedding_dim.cut``: what a Matryoshka run,
  ``--matryoshka_dims``, was trained to make good embeddings of); ``usage`` counts the tokens
  the model read (each text cut at the model's caption length, special tokens included; an image counts 0).
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model served, its id the name ``GET /meta`` gives (the model
  folder's base name; its path with ``--show_absolute_paths``). A request naming another model is 404
  ``model_not_found``.

An image is its file's bytes in base64, bare or as a ``data:`` URL; an image URL is refused (nothing is fetched).
Token arrays are refused too: the served tokenizer is not OpenAI's. A request is bounded as a ``/vectorize`` is, and
in its queue and on its thread (``vlfit.serve.admission``): the body (``--max_upload_mb``), ``MAX_VECTORIZE_ITEMS``
items, each text (``--max_text_chars``), each image's pixels read from its header (``--max_query_pixels``).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: the route's own, and, through
``OpenAIErrors``, what the server's middlewares answer on a ``/v1/`` path in its plain shape (401 for a missing key
with ``code`` ``invalid_api_key``, 413, 415, 429 and 503 with ``Retry-After``); a 422 of the JSON reader is a 400
here, as OpenAI answers one. Refusals by the connection itself, before the app (``vlfit.serve.connections``: over
``--max_concurrency`` or the wait budget from the request head), keep the plain shape: the ``openai`` client reads
both, and retries a 429 or 503 after its ``Retry-After``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Literal

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from vlfit.index.stages import StageTimes
from vlfit.inference.embedding_dim import cut
from vlfit.serve.disconnects import ClientGone, unless_disconnected
from vlfit.serve.engine import SearchEngine
from vlfit.serve.json_body import decode_base64, read_json, text_problem
from vlfit.serve.limits import EMBEDDINGS_PATH, ServerLimits
from vlfit.serve.metrics import ServerMetrics
from vlfit.serve.responses import internal_error
from vlfit.serve.weaviate import MAX_VECTORIZE_ITEMS, ItemRefused, model_name, vectorize

logger = logging.getLogger(__name__)

PREFIX = "/v1/"
MODELS_PATH = "/v1/models"
OWNED_BY = "vlfit"
_EXAMPLE = 'send {"model": "<GET /v1/models>", "input": ["a caption", {"image": "<base64 of an image file>"}]}'
_ITEM = 'a string, {"text": "..."} or {"image": "<base64 or data: URL>"}'

Item = str | bytes  # a text, or an image's encoded bytes


class EmbeddingsBody(BaseModel):
    """A ``POST /v1/embeddings`` body (OpenAI's fields; ``input``'s items are checked one by one, by position)."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    input: StrictStr | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None  # OpenAI's end-user id: taken, not used


class Refused(Exception):
    """A request refused in OpenAI's shape: the status, the message, and the ``param`` and ``code`` it names."""

    def __init__(self, status: int, message: str, param: str | None = "input", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        return openai_error(self.status, str(self), param=self.param, code=self.code)


def openai_error(
    status: int, message: str, *, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    """OpenAI's error answer; a 422 is a 400 (OpenAI answers a body it cannot take 400), ``type`` follows the
    status (``invalid_request_error``; 429: ``requests``; 5xx: ``server_error``)."""
    status = 400 if status == 422 else status
    kind = "server_error" if status >= 500 else "requests" if status == 429 else "invalid_request_error"
    if code is None:
        code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
    error = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class OpenAIErrors:
    """ASGI middleware: on a ``/v1/`` path, an error the server answers in its plain shape (``{"error": "..."}``, or
    Starlette's ``{"detail": "..."}`` for a path or method not served) is sent in OpenAI's, headers kept
    (``Retry-After``, ``WWW-Authenticate``). It sits outside the key check and the limits, inside the metrics."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def reshaping_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and int(message["status"]) >= 400:
                start = message  # held until the body is whole
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                for part in _reshaped(start, b"".join(chunks)):
                    await send(part)

        await self.app(scope, receive, reshaping_send)


def _reshaped(start: dict, body: bytes) -> list[dict]:
    """The response messages of an error ``start`` with ``body``, in OpenAI's shape when it was in the plain one."""
    try:
        plain = json.loads(body)
    except ValueError:
        plain = None
    message = plain.get("error", plain.get("detail")) if isinstance(plain, dict) else None
    if not isinstance(message, str):  # OpenAI's already, or not JSON (a HEAD's empty body): as it was
        return [start, {"type": "http.response.body", "body": body}]
    drop = (b"content-length", b"content-type")
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in start.get("headers", [])
               if name.lower() not in drop}  # fmt: skip
    answer = openai_error(int(start["status"]), message, headers=headers)
    return [{"type": "http.response.start", "status": answer.status_code, "headers": answer.raw_headers},
            {"type": "http.response.body", "body": answer.body}]  # fmt: skip


def read_items(body: EmbeddingsBody, max_text_chars: int) -> list[Item]:
    """``body.input`` as texts and images' bytes, in order, each checked (see the module).

    Raises:
        Refused: naming the item (``input[2]``) and what to send.
    """
    raw = [body.input] if isinstance(body.input, str) else body.input
    if not raw:
        raise Refused(400, f"input is empty: send at least one item ({_ITEM})")
    if len(raw) > MAX_VECTORIZE_ITEMS:
        raise Refused(400, f"input has {len(raw)} items, over the limit of {MAX_VECTORIZE_ITEMS} a request: send "
                      "them in several requests (LangChain: chunk_size; LlamaIndex: embed_batch_size)")  # fmt: skip
    items: list[Item] = []
    for i, item in enumerate(raw):
        name = "input" if isinstance(body.input, str) else f"input[{i}]"
        if isinstance(item, dict) and len(item) == 1 and isinstance(item.get("text"), str):
            item, name = item["text"], f"{name}.text"
        if isinstance(item, str):
            items.append(_text(item, name, max_text_chars))
        elif isinstance(item, dict) and len(item) == 1 and isinstance(item.get("image"), str):
            items.append(_image(item["image"], f"{name}.image"))
        elif _is_token(item) or (isinstance(item, list) and item and all(map(_is_token, item))):
            raise Refused(400, f"{name} is token ids: this server tokenizes texts itself, send them as strings "
                          "(LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)")  # fmt: skip
        else:
            raise Refused(400, f"{name} is {json.dumps(item)[:60]}: each item is {_ITEM}")
    return items


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(text: str, name: str, max_chars: int) -> str:
    if not text:
        raise Refused(400, f"{name} is an empty string: send a text to embed")
    problem = text_problem(text, max_chars, name)
    if problem:
        raise Refused(400, problem)
    return text


def _image(value: str, name: str) -> bytes:
    """An image item's bytes: bare base64 or a ``data:`` URL's."""
    if value[:8].lower().startswith(("http://", "https://")):
        raise Refused(400, f"{name} is a URL: URLs are refused (nothing is fetched); send the image's bytes as base64")
    if value[:5].lower() == "data:":
        header, comma, value = value.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise Refused(400, f"{name} is a data: URL without ';base64,': send data:image/...;base64,<bytes>")
    try:
        return decode_base64(value, name)
    except ValueError as err:
        raise Refused(400, str(err)) from None


def embed_items(
    engine: SearchEngine, items: Sequence[Item], max_pixels: int, times: StageTimes
) -> tuple[list[list[float]], int]:
    """Each item's embedding, in order (``vlfit.serve.weaviate.vectorize``: the texts together, the images one at a
    time), and the tokens the model read for the texts (each cut at the caption length, special tokens included).

    Raises:
        ItemRefused: for an image over ``max_pixels`` or bytes that are not an image, naming its item.
    """
    texts = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
    images = [(i, item) for i, item in enumerate(items) if isinstance(item, bytes)]
    answer = vectorize(engine, [text for _, text in texts], [image for _, image in images], max_pixels, times,
                       image_names=[f"input[{i}]" for i, _ in images])  # fmt: skip
    vectors: list[list[float]] = [[] for _ in items]
    for (i, _), vector in zip(texts + images, answer["textVectors"] + answer["imageVectors"], strict=True):
        vectors[i] = vector
    tokens = int(engine.encoder.tokenize([text for _, text in texts])["attention_mask"].sum()) if texts else 0
    return vectors, tokens


def embeddings_answer(vectors: Sequence[Sequence[float]], model: str, tokens: int, encoding_format: str) -> dict:
    """What ``POST /v1/embeddings`` answers: OpenAI's list of embeddings, each as floats or as base64 of its
    little-endian float32 bytes."""

    def encoded(vector: Sequence[float]) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        return list(vector)

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def add_openai_routes(
    app: FastAPI, engine: SearchEngine, *, limits: ServerLimits, metrics: ServerMetrics, pool: Executor
) -> None:
    """Answer OpenAI's embeddings and models routes on ``app`` (see the module); ``pool`` runs the embedding (the
    vectorizing thread). ``OpenAIErrors`` must wrap the app's key check and limits for their errors' shape."""
    name = model_name(engine)
    size = engine.encoder.identity.embedding_size
    path = engine.encoder.model_path
    created = int(os.path.getmtime(path) if os.path.exists(path) else time.time())  # a hub id or preset: now
    card = {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY}

    def unknown(model: str, param: str | None) -> JSONResponse:
        return openai_error(404, f"the model {model[:200]!r} is not served here: this server serves {name!r} (GET "
                            f"{MODELS_PATH})", param=param, code="model_not_found")  # fmt: skip

    @app.get(MODELS_PATH)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    @app.get(MODELS_PATH + "/{model:path}")
    async def one_model(model: str) -> JSONResponse:
        return JSONResponse(card) if model == name else unknown(model, None)

    @app.post(EMBEDDINGS_PATH)
    async def embeddings(request: Request) -> Response:
        body = await read_json(request, EmbeddingsBody, what="embeddings request", example=_EXAMPLE)
        if isinstance(body, Response):
            return body  # the plain shape: OpenAIErrors reshapes it
        if body.model != name:
            return unknown(body.model, "model")
        try:
            if body.dimensions is not None and not 1 <= body.dimensions <= size:
                raise Refused(400, f"dimensions {body.dimensions}: this model's embeddings have {size}; ask for 1 to "
                              f"{size} (its first dimensions, normalised again) or leave dimensions out",
                              param="dimensions")  # fmt: skip
            items = read_items(body, limits.max_text_chars)
        except Refused as err:
            return err.response()
        times = StageTimes()
        try:
            vectors, tokens = await unless_disconnected(
                request, pool, lambda: embed_items(engine, items, limits.max_query_pixels, times)
            )
        except ClientGone:
            return Response(status_code=499)
        except ItemRefused as err:
            return openai_error(err.status, str(err), param="input")
        except Exception as err:  # noqa: BLE001 - this request's failure, and only this request's
            texts = sum(isinstance(item, str) for item in items)
            what = f"an embeddings request ({texts} texts, {len(items) - texts} images)"
            return internal_error(logger, what, err)
        metrics.observe_stages(times.seconds)
        if body.dimensions is not None and body.dimensions < size:  # a Matryoshka run's prefixes, as OpenAI's v3
            vectors = cut(torch.tensor(vectors), body.dimensions).tolist()
        return JSONResponse(embeddings_answer(vectors, name, tokens, body.encoding_format))
