"""Weaviate's multi2vec inference protocol on ``vlfit serve``: a Weaviate with the ``multi2vec-clip`` module whose
``CLIP_INFERENCE_API`` points at the server vectorizes its objects and its ``nearText``/``nearImage`` queries with
the served model.

The protocol is the one the module's client speaks (Weaviate 1.2x: ``modules/multi2vec-clip/clients``), and
``weaviate/multi2vec-clip-inference``'s container answers:

- ``POST /vectorize`` ``{"texts": ["..."], "images": ["<base64>"]}`` -> ``{"textVectors": [[...]], "imageVectors":
  [[...]]}``, one L2-normalized vector per item, in order (either list may be empty or ``null``); errors are
  ``{"error": "..."}``, the field the client reads, with a 4xx naming the item;
- ``GET /meta``: a JSON object, which Weaviate shows under its own ``/v1/meta``: here the model's identity;
- ``GET /.well-known/live`` and ``GET /.well-known/ready``: 204 (the server answers once the model is loaded; Weaviate
  waits on ``ready`` before it starts).

The vectors are the model's own: ``vlfit.load(model).encode_texts`` / ``encode_images`` of the same inputs (the
texts 256 to a batch, the images one at a time, decoded as every door decodes them). A request is bounded as a
search is: the body (``--max_upload_mb``), each text (``--max_text_chars``), each image's pixels read from its
header before it is decoded (``--max_query_pixels``), ``MAX_VECTORIZE_ITEMS`` items, requests in flight and the
expected wait (a queue of its own, ``vlfit.serve.admission``); it runs on a thread of its own at the image
threads' lower priority, so a bulk import never holds up a search. Keys and metrics are the other routes'
(``vlfit.serve.access``: Weaviate sends the key as the password of a URL's ``user:key@``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictStr

from vlfit.data.decode import DecodeError
from vlfit.errors import DataError, first_line
from vlfit.index.stages import StageTimes
from vlfit.models.family import InputSpec
from vlfit.serve.disconnects import ClientGone, unless_disconnected
from vlfit.serve.engine import SearchEngine
from vlfit.serve.images import QueryImageTooLarge, check_query_pixels
from vlfit.serve.json_body import decode_base64, read_json, text_problem
from vlfit.serve.limits import VECTORIZE_PATH, WEAVIATE_PROBES, ServerLimits
from vlfit.serve.metrics import ServerMetrics
from vlfit.serve.responses import error_response, internal_error
from vlfit.version import __version__

logger = logging.getLogger(__name__)

META_PATH = "/meta"
# Texts and images of one request together. Weaviate sends one object's text and image fields per request (a few
# items); this bounds what one request may hold the vectorizing thread for.
MAX_VECTORIZE_ITEMS = 64
_EXAMPLE = 'send {"texts": ["a caption"], "images": ["<base64 of an image file>"]}'


class VectorizeBody(BaseModel):
    """A ``POST /vectorize`` body: texts and base64 images, either list may be missing or ``null``."""

    model_config = ConfigDict(extra="forbid")
    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = None


@dataclass(frozen=True)
class VectorizeRequest:
    """A checked ``POST /vectorize``: the texts and the images' encoded bytes (their pixels not yet checked)."""

    texts: list[str]
    images: list[bytes]


class ItemRefused(Exception):
    """An item of a vectorize request that is not vectorized: the status and the one line the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_vectorize(request: Request, max_text_chars: int) -> VectorizeRequest | JSONResponse:
    """The checked body of ``POST /vectorize``, or the error response it gets (``vlfit.serve.json_body``: UTF-8, no
    duplicate keys, bounded nesting, unknown fields refused). An empty text is taken: Weaviate sends an object's
    empty text fields too, and the model embeds them as the inference container does."""
    fields = await read_json(request, VectorizeBody, what="vectorize request", example=_EXAMPLE)
    if isinstance(fields, JSONResponse):
        return fields
    texts, encoded = fields.texts or [], fields.images or []
    if len(texts) + len(encoded) > MAX_VECTORIZE_ITEMS:
        return error_response(422, f"{len(texts)} texts and {len(encoded)} images in one request, over the limit "
                              f"of {MAX_VECTORIZE_ITEMS} items: send them in several requests")  # fmt: skip
    for i, text in enumerate(texts):
        problem = text_problem(text, max_text_chars, f"texts[{i}]")
        if problem:
            return error_response(422, problem)
    images = []
    for i, image in enumerate(encoded):
        try:
            images.append(decode_base64(image, f"images[{i}]"))
        except ValueError as err:
            return error_response(400, str(err))
    return VectorizeRequest(texts, images)


def vectorize(
    engine: SearchEngine,
    texts: Sequence[str],
    images: Sequence[bytes],
    max_pixels: int,
    times: StageTimes,
    image_names: Sequence[str] | None = None,
) -> dict[str, list[list[float]]]:
    """The answer of ``POST /vectorize``: each text's and each image's embedding, in order (the images one at a time,
    each as an image search embeds its query: ``SearchEngine.encode_image``). ``image_names`` name the images in
    errors (default ``images[i]``).

    Raises:
        ItemRefused: for an image over ``max_pixels`` (422) or bytes that are not an image (400), naming it.
    """
    text_vectors = engine.encode_texts(texts, times).tolist() if texts else []
    image_vectors = []
    for i, image in enumerate(images):
        name = image_names[i] if image_names is not None else f"images[{i}]"
        try:
            with times.stage("decode"):
                check_query_pixels(image, max_pixels, name=name)
            image_vectors += engine.encode_image(image, times).tolist()
        except QueryImageTooLarge as err:
            raise ItemRefused(422, f"{name}: {err}") from None
        except DataError as err:  # a DecodeError's reason without the sample it names (the engine's images[0])
            reason = err.reason if isinstance(err, DecodeError) and err.reason else first_line(err)
            raise ItemRefused(400, f"{name} is not an image vlfit can read: {reason}") from None
    return {"textVectors": text_vectors, "imageVectors": image_vectors}


def model_meta(engine: SearchEngine) -> dict[str, object]:
    """What ``GET /meta`` answers: the served model's identity (its folder by name unless ``absolute_paths``)."""
    encoder = engine.encoder
    spec = encoder.spec
    return {
        "model": {
            "name": model_name(engine),
            **encoder.identity.to_dict(),
            "backend": encoder.backend,
            "precision": encoder.precision,
            **_image_input(spec),
            "max_seq_length": spec.max_seq_length,
        },  # fmt: skip
        "server": f"vlfit serve {__version__}",
        "protocol": "multi2vec-clip",
    }


def model_name(engine: SearchEngine) -> str:
    """The served model's name: its folder's (or preset's) base name, its path with ``absolute_paths``."""
    path = engine.encoder.model_path
    return path if engine.absolute_paths else os.path.basename(path.rstrip(os.sep))


def _image_input(spec: InputSpec) -> dict[str, int | None]:
    """The images the served model takes: a NaFlex model's patch budget and patch side, else its square side."""
    if spec.max_num_patches is not None:
        return {"max_num_patches": spec.max_num_patches, "patch_size": spec.patch_size}
    return {"image_size": spec.image_size}


def add_weaviate_routes(
    app: FastAPI, engine: SearchEngine, *, limits: ServerLimits, metrics: ServerMetrics, pool: Executor
) -> None:
    """Answer Weaviate's multi2vec protocol on ``app`` (see the module); ``pool`` runs the vectorizing."""

    async def probe() -> Response:
        return Response(status_code=204)  # the app exists once its model loaded: live and ready alike

    for path in WEAVIATE_PROBES:
        app.add_api_route(path, probe, methods=["GET"])

    @app.get(META_PATH)
    async def meta() -> JSONResponse:
        return JSONResponse(model_meta(engine))

    @app.post(VECTORIZE_PATH)
    async def vectorize_route(request: Request) -> Response:
        checked = await read_vectorize(request, limits.max_text_chars)
        if isinstance(checked, Response):
            return checked
        if not checked.texts and not checked.images:
            return JSONResponse({"textVectors": [], "imageVectors": []})
        times = StageTimes()

        def work() -> dict[str, list[list[float]]]:
            return vectorize(engine, checked.texts, checked.images, limits.max_query_pixels, times)

        try:
            answer = await unless_disconnected(request, pool, work)
        except ClientGone:
            return Response(status_code=499)
        except ItemRefused as err:
            return error_response(err.status, str(err))
        except Exception as err:  # noqa: BLE001 - this request's failure, and only this request's
            what = f"a vectorize request ({len(checked.texts)} texts, {len(checked.images)} images)"
            return internal_error(logger, what, err)
        metrics.observe_stages(times.seconds)
        return JSONResponse(answer)
