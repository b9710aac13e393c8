"""Requests the server does not guess at, on the real ``vlfit serve`` process: JSON that is not UTF-8 is 400, a
charset other than UTF-8 415, base64 without its padding 400, and an item number that is not ASCII digits (which
``int`` would take: ``+1``, `` 1``, ``1_0``, Arabic-Indic digits) 404; each answer names the rule, and the same
request sent as the rule says is answered 200.

One server for the module, on a free loopback port, stopped by the module; every request has a timeout."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from tests.inference.several_captions import jpeg
from tests.serve.test_image_errors import folder_server

pytestmark = pytest.mark.slow

TIMEOUT = 30
QUERY = {"text": "a red picture", "k": 2}


@pytest.fixture(scope="module")
def base(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lenient")
    (root / "photos").mkdir()
    for number in range(3):
        (root / "photos" / f"p{number}.jpg").write_bytes(jpeg(number))
    with folder_server(tiny_checkpoint, root / "photos", root) as (url, _, _):
        yield url


def _post(base: str, body: bytes, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(f"{base}/api/search", content=body, headers={"Content-Type": content_type}, timeout=TIMEOUT)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "latin-1", "utf-8-sig"])
def test_json_that_is_not_utf8_is_400_naming_the_encoding(base, encoding) -> None:
    text = json.dumps({**QUERY, "text": "a red café"}, ensure_ascii=False)
    answer = _post(base, text.encode(encoding))
    assert answer.status_code == 400 and "send UTF-8 JSON" in answer.json()["error"]
    assert _post(base, text.encode("utf-8")).status_code == 200


def test_a_charset_other_than_utf8_is_415_naming_the_media_type(base) -> None:
    body = json.dumps(QUERY).encode()
    answer = _post(base, body, "application/json; charset=latin-1")
    assert answer.status_code == 415
    assert "application/json in UTF-8" in answer.json()["error"] and "charset=latin-1" in answer.json()["error"]
    assert _post(base, body, 'application/json; charset="UTF-8"').status_code == 200


def test_base64_without_its_padding_is_400_naming_the_field(base) -> None:
    image = jpeg(1)
    encoded = base64.b64encode(image if len(image) % 3 else image + b"\0").decode()
    assert encoded.endswith("=")
    answer = _post(base, json.dumps({"image": encoded.rstrip("="), "k": 2}).encode())
    assert answer.status_code == 400
    assert answer.json()["error"].startswith('"image" is base64 without its padding')
    assert _post(base, json.dumps({"image": base64.b64encode(image).decode(), "k": 2}).encode()).status_code == 200


@pytest.mark.parametrize("item", ["%2B1", "%201", "1_0", "%D9%A3", "1%20", "0x1"])
def test_an_item_number_that_is_not_ascii_digits_is_404_naming_what_one_is(base, item) -> None:
    answer = httpx.get(f"{base}/api/image/{item}?size=32", timeout=TIMEOUT)
    assert answer.status_code == 404 and "an item number is ASCII digits only" in answer.json()["error"]
    assert httpx.get(f"{base}/api/image/1?size=32", timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize("size", ["%2B96", "%2096", "9_6", "%D9%A3", "0x60", "96.0"])
def test_a_thumbnail_size_that_is_not_ascii_digits_is_400_naming_it(base, size) -> None:
    answer = httpx.get(f"{base}/api/image/1?size={size}", timeout=TIMEOUT)
    assert answer.status_code == 400 and "a thumbnail's side is ASCII digits, 16 to 1024" in answer.json()["error"]
    assert answer.json()["error"].startswith("size '")
