"""Requests read and checked before anything is computed for them: ``read_query`` turns a search's body into a
``Query`` or the error response it gets, ``ascii_number`` the ``{item}`` and ``?size=`` of ``GET /api/image/{item}``
into numbers.

Every check here is cheap and runs on the event loop, so a bad request is answered without touching the encoder
and never joins a batch with good ones. Nothing lenient is taken: what a client sends wrong is answered 4xx, not
guessed at.

- JSON: read as every route reads its JSON body (``vlfit.serve.json_body``: UTF-8, no duplicate keys, bounded
  nesting, unknown fields and ``k`` that is not a JSON integer (``true``, ``"5"``, ``5.0``) refused);
- text: empty, longer than ``max_text_chars``, or not valid Unicode -> 422, naming the field and the limit;
- multipart: exactly one file part, ``file``; ``k`` as a form field of digits; more than one file -> 400;
- ``image``: standard base64 with its padding -> 400 when it is not (no URL-safe alphabet, no missing ``=``);
- an item number: ASCII digits only (``int`` would take ``+1``, `` 1``, ``1_0`` and other scripts' digits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from vlfit.serve.json_body import content_type, decode_base64, read_json, text_problem
from vlfit.serve.responses import error_response

MULTIPART_MAX_FIELDS = 8
MAX_ITEM_DIGITS = 18  # an item number's digits: far above any index's rows, far below int()'s digit limit
ITEM_NUMBER_RULE = 'an item number is ASCII digits only, a search result\'s "row" (GET /api/image/3)'
_EXAMPLE = 'send {"text": "...", "k": 10}'


class SearchQuery(BaseModel):
    """A JSON search request: exactly one of ``text`` and ``image`` (base64 of the encoded image bytes)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    image: str | None = None
    k: StrictInt = 10  # a JSON integer: no bool, string or float
    rerank: StrictInt | None = None  # text queries: candidates re-scored by the matching head
    rerank_score: Literal["itm", "itm+itc"] | None = None  # what they are ordered by (default: the server's)


@dataclass(frozen=True)
class Query:
    """A checked search request: ``text`` or ``image`` (encoded bytes), ``k`` and, for a text, ``rerank`` (the
    candidates the matching head re-scores; neither yet range-checked) and ``rerank_score``."""

    text: str | None
    image: bytes | None
    k: int
    rerank: int | None = None
    rerank_score: str | None = None


def ascii_number(text: str) -> int | None:
    """A number of a request's path or query (the ``{item}`` row and ``?size=`` of ``GET /api/image/{item}``): ASCII
    digits only (``MAX_ITEM_DIGITS`` at most); None for anything else, which ``int`` may take (``+1``, `` 1``,
    ``1_0``, ``\u0663``) but no result ever shows."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_ITEM_DIGITS:
        return int(text)
    return None


def check_text(text: str, max_chars: int) -> str | None:
    """Why ``text`` cannot be a query (``None``: it can)."""
    if not text.strip():
        return '"text" is empty'
    return text_problem(text, max_chars, '"text"')


async def read_query(request: Request, max_text_chars: int) -> Query | JSONResponse:
    """The checked query of a search request (texts of at most ``max_text_chars``), or the error response it gets."""
    media_type, _ = content_type(request.headers.get("content-type", ""))
    if media_type == "multipart/form-data":
        return await _read_multipart(request)
    query = await read_json(request, SearchQuery, what="search request", example=_EXAMPLE)
    if isinstance(query, JSONResponse):
        return query
    if (query.text is None) == (query.image is None):
        return error_response(422, 'a search takes exactly one of "text" and "image" (base64 of the image file)')
    if query.text is not None:
        problem = check_text(query.text, max_text_chars)
        return error_response(422, problem) if problem else Query(query.text, None, query.k, query.rerank,
                                                                  query.rerank_score)  # fmt: skip
    if query.rerank is not None or query.rerank_score is not None:
        return error_response(422, '"rerank" re-ranks text queries (the matching head scores a caption against an '
                              "image): search an image without it")  # fmt: skip
    try:
        image = decode_base64(query.image or "", '"image"')
    except ValueError as err:
        return error_response(400, str(err))
    return Query(None, image, query.k)


async def _read_multipart(request: Request) -> Query | JSONResponse:
    try:  # more file parts than one, or many fields, are refused while parsing: never spooled
        form = await request.form(max_files=1, max_fields=MULTIPART_MAX_FIELDS)
    except HTTPException as err:
        return error_response(400, f"a multipart search takes one image file in the field 'file': {err.detail}")
    files = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        return error_response(422, "a multipart search needs the image file in the field 'file'")
    if len(files) > 1 or len(form.getlist("k")) > 1:
        return error_response(400, "a multipart search takes one image file in the field 'file' and at most one k")
    raw_k = form.get("k", "10")
    if not isinstance(raw_k, str) or not re.fullmatch(r"[0-9]{1,9}", raw_k):
        return error_response(422, f"k must be an integer, got {raw_k!r}")
    return Query(None, await upload.read(), int(raw_k))
