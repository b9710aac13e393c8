"""One reader of a route's JSON body: ``read_json(request, Model, what=..., example=...)`` is the body as a pydantic
model, or the error response it gets, checked before anything is computed for it. ``/api/search`` and Weaviate's
``/vectorize`` read their bodies with it, and so does any route that takes JSON; each route then checks its own
fields (``text_problem`` for a text, ``decode_base64`` for an image).

Nothing lenient is taken: what a client sends wrong is answered 4xx, not guessed at.

- a ``charset`` other than UTF-8 -> 415; a body that is not UTF-8 (UTF-16 and UTF-32, which ``json.loads`` would
  detect, or a byte order mark) -> 400;
- malformed JSON, duplicate keys, nesting deeper than ``MAX_JSON_DEPTH``, unknown fields or a field of the wrong
  type (the models' ``StrictInt`` refuses ``true``, ``"5"``, ``5.0``) -> 422, naming the field and ending with what
  to send;
- a text longer than the route's limit, or not valid Unicode (a lone surrogate such as ``"\\ud800"``, which no UTF-8
  encoder or tokenizer takes) -> 422, naming the field and the limit;
- an image: standard base64 with its padding -> 400 when it is not (no URL-safe alphabet, no missing ``=``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from vlfit.data.text_checks import unicode_problem
from vlfit.serve.responses import error_response

MAX_JSON_DEPTH = 8  # a request is one flat object; this leaves room and refuses pathological nesting
UTF8_CHARSETS = ("utf-8", "utf8")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")  # the standard alphabet; its length is checked apart

BodyModel = TypeVar("BodyModel", bound=BaseModel)


class NotUtf8Error(ValueError):
    """A JSON body that is not UTF-8 (the message says where)."""


class _DuplicateKey(ValueError):
    pass


async def read_json(request: Request, model: type[BodyModel], *, what: str, example: str) -> BodyModel | JSONResponse:
    """``request``'s JSON body validated as ``model``, or the error response it gets (see the module).

    Args:
        request: A request whose body is JSON (its ``Content-Type`` was checked by ``vlfit.serve.access``).
        model: The body's fields; unknown ones are refused when it forbids extras.
        what: What the body is, as its 422 names it (``"search request"``).
        example: What to send, ending the 422 of a body of the wrong shape (``'send {"text": "...", "k": 10}'``).
    """
    _, charset = content_type(request.headers.get("content-type", ""))
    if charset is not None and charset not in UTF8_CHARSETS:
        return error_response(415, f"{request.url.path} takes application/json in UTF-8 (charset=utf-8 or none), "
                              f"not charset={charset[:40]}: send UTF-8 JSON")  # fmt: skip
    try:
        body = parse_json(await request.body())
    except NotUtf8Error as err:
        return error_response(400, str(err))
    except ValueError as err:
        return error_response(422, f"{err}; {example}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
        return error_response(422, f"invalid {what}: {problems}; {example}")


def content_type(header: str) -> tuple[str, str | None]:
    """The media type of a ``Content-Type`` header and its ``charset`` (lower case, unquoted; None: none given)."""
    media_type, *params = header.split(";")
    charset = None
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    return media_type.strip().lower(), charset


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


def text_problem(text: str, max_chars: int, field: str) -> str | None:
    """Why ``text``, the body's ``field``, cannot be embedded (``None``: it can): over ``max_chars`` characters, or
    not valid Unicode (``vlfit.data.text_checks``, the API's rule too). Whether an empty text can is the route's
    rule."""
    if len(text) > max_chars:
        return f"{field} is {len(text)} characters, over the limit of {max_chars} (--max_text_chars)"
    return unicode_problem(text, field)


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
