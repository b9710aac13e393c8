"""Requests read and checked before anything is computed for them: ``read_query`` turns a search's body into a
``Query`` or the error response it gets, ``ascii_number`` the ``{item}`` and ``?size=`` of ``GET /api/image/{item}``
into numbers.

Every check here is cheap and runs on the event loop, so a bad request is answered without touching the encoder
and never joins a batch with good ones. Nothing lenient is taken: what a client sends wrong is answered 4xx, not
guessed at.

- JSON: a ``charset`` other than UTF-8 -> 415; a body that is not UTF-8 (UTF-16 and UTF-32, which ``json.loads``
  would detect, or a byte order mark) -> 400; duplicate keys, nesting deeper than ``MAX_JSON_DEPTH``, unknown
  fields, ``k`` that is not a JSON integer (``true``, ``"5"``, ``5.0``) -> 422;
- text: empty, longer than ``max_text_chars``, or not valid Unicode (a lone surrogate such as ``"\\ud800"``, which
  no UTF-8 encoder or tokenizer takes) -> 422, naming the field and the limit;
- multipart: exactly one file part, ``file``; ``k`` as a form field of digits; more than one file -> 400;
- ``image``: standard base64 with its padding -> 400 when it is not (no URL-safe alphabet, no missing ``=``);
- an item number: ASCII digits only (``int`` would take ``+1``, `` 1``, ``1_0`` and other scripts' digits).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

MAX_JSON_DEPTH = 8  # a search request is one flat object; this leaves room and refuses pathological nesting
MULTIPART_MAX_FIELDS = 8
MAX_ITEM_DIGITS = 18  # an item number's digits: far above any index's rows, far below int()'s digit limit
ITEM_NUMBER_RULE = 'an item number is ASCII digits only, a search result\'s "row" (GET /api/image/3)'
UTF8_CHARSETS = ("utf-8", "utf8")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")  # the standard alphabet; its length is checked apart


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


class _DuplicateKey(ValueError):
    pass


class NotUtf8Error(ValueError):
    """A JSON body that is not UTF-8 (the message says where)."""


def ascii_number(text: str) -> int | None:
    """A number of a request's path or query (the ``{item}`` row and ``?size=`` of ``GET /api/image/{item}``): ASCII
    digits only (``MAX_ITEM_DIGITS`` at most); None for anything else, which ``int`` may take (``+1``, `` 1``,
    ``1_0``, ``\u0663``) but no result ever shows."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_ITEM_DIGITS:
        return int(text)
    return None


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The server's error answer: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(key)
        found[key] = value
    return found


def _depth(value: Any) -> int:
    """How deep ``value`` nests (a scalar 0, a flat object 1), iteratively: never recursion-bound."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            level += 1
            deepest = max(deepest, level)
            stack.extend((child, level) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body``.

    Raises:
        NotUtf8Error: for a body that is not UTF-8 (or starts with a byte order mark).
        ValueError: for malformed JSON, duplicate keys, or nesting deeper than ``MAX_JSON_DEPTH`` (the message
            says which).
    """
    text = utf8_text(body)
    try:
        value = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as err:
        raise ValueError(f"the key {err.args[0]!r} appears more than once in one object") from None
    except RecursionError:  # the C parser's own bound: far deeper than MAX_JSON_DEPTH
        raise ValueError(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"the request body is not valid JSON ({err})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def utf8_text(body: bytes) -> str:
    """``body`` decoded as UTF-8, strictly: JSON is UTF-8 (RFC 8259), and ``json.loads`` of bytes would guess
    UTF-16 or UTF-32 from their NUL bytes, which UTF-8 JSON never holds.

    Raises:
        NotUtf8Error: naming what was found and the rule.
    """
    rule = "send UTF-8 JSON"
    if body.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise NotUtf8Error(f"the request body starts with a byte order mark: {rule}, without one")
    if b"\x00" in body:
        raise NotUtf8Error(f"the request body holds NUL bytes (UTF-16 or UTF-32, not UTF-8): {rule}")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NotUtf8Error(f"the request body is not UTF-8 (byte {err.start} is invalid): {rule}") from None


def check_text(text: str, max_chars: int) -> str | None:
    """Why ``text`` cannot be a query (``None``: it can)."""
    if not text.strip():
        return '"text" is empty'
    if len(text) > max_chars:
        return f'"text" is {len(text)} characters, over the limit of {max_chars} (--max_text_chars)'
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f'"text" is not valid Unicode text: {err.reason} at character {err.start}'
    return None


async def read_query(request: Request, max_text_chars: int) -> Query | JSONResponse:
    """The checked query of a search request (texts of at most ``max_text_chars``), or the error response it gets."""
    media_type, charset = content_type(request.headers.get("content-type", ""))
    if media_type == "multipart/form-data":
        return await _read_multipart(request)
    if charset is not None and charset not in UTF8_CHARSETS:
        return error_response(415, f"{request.url.path} takes application/json in UTF-8 (charset=utf-8 or none), "
                              f"not charset={charset[:40]}: send UTF-8 JSON")  # fmt: skip
    try:
        body = parse_json(await request.body())
    except NotUtf8Error as err:
        return error_response(400, str(err))
    except ValueError as err:
        return error_response(422, f'{err}; send {{"text": "...", "k": 10}}')
    try:
        query = SearchQuery.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
        return error_response(422, f"invalid search request: {problems}")
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


def decode_base64(encoded: str, field: str) -> bytes:
    """The bytes of an image sent as standard base64 with its padding (``field`` names it in the message).

    Raises:
        ValueError: saying what is wrong (no padding, not base64) and what to send.
    """
    if _BASE64.fullmatch(encoded) and len(encoded) % 4:  # b64decode says "Incorrect padding": say what is missing
        raise ValueError(f"{field} is base64 without its padding (its length is not a multiple of 4): send the "
                         "image file's bytes in standard base64, with the trailing '='")  # fmt: skip
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{field} is not base64 ({err}): send the image file's bytes base64-encoded") from None


def content_type(header: str) -> tuple[str, str | None]:
    """The media type of a ``Content-Type`` header and its ``charset`` (lower case, unquoted; None: none given)."""
    media_type, *params = header.split(";")
    charset = None
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    return media_type.strip().lower(), charset


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
