"""Weaviate's multi2vec-clip protocol on the real app in-process (the real engine on a tiny model): the request and
response shapes the module's client sends and reads, vectors equal to the model's own, bad items answered 4xx
naming the item (a good request answered after each), keys, metrics and the vectorize queue's admission."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import vlfit
from tests.serve.test_limits import PRIVATE_PATH, assert_internal_error
from vlfit.data.decode import DecodeError, decode_scaled
from vlfit.index.stages import StageTimes
from vlfit.serve.access import AccessPolicy
from vlfit.serve.app import create_app
from vlfit.serve.engine import SearchEngine
from vlfit.serve.limits import ServerLimits
from vlfit.serve.weaviate import MAX_VECTORIZE_ITEMS, ItemRefused, vectorize

KEY = "k-" + "5" * 30
LOCAL = "http://127.0.0.1:8000"  # a Host the access policy answers
_PNG = io.BytesIO()
Image.new("RGB", (40, 30), "red").save(_PNG, "PNG")
RED = base64.b64encode(_PNG.getvalue()).decode()
_JPEG = io.BytesIO()
Image.fromarray(np.random.default_rng(1).integers(0, 256, (200, 300, 3), dtype=np.uint8)).save(_JPEG, "JPEG")
TRUNCATED = _JPEG.getvalue()[:2000]  # its header reads, its pixels do not decode
TEXTS = ["one red circle", "two blue squares and a green cross", ""]  # Weaviate sends empty text fields too


@pytest.fixture(scope="module")
def tiny_index(tiny_checkpoint: Path, synthetic_dataset_dir: str, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("weaviate") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(path), dataset_name=synthetic_dataset_dir, split="validation")
    return path


@pytest.fixture(scope="module")
def engine(tiny_index: Path) -> SearchEngine:
    return SearchEngine(str(tiny_index))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, reload_interval=0, limits=ServerLimits(max_query_pixels=200_000))) as client:
        yield client


@pytest.fixture(scope="module")
def photos(synthetic_dataset_dir) -> list[bytes]:
    """Three images of the dataset (JPEG, of other sizes than square), and one PNG of 301x173 pixels."""
    from vlfit.data.sources import open_splits

    split = open_splits(dataset_name=synthetic_dataset_dir)["validation"]
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (173, 301, 3), dtype=np.uint8)).save(png, "PNG")
    return [split[i].image for i in range(3)] + [png.getvalue()]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _keyed(engine: SearchEngine) -> TestClient:
    return TestClient(create_app(engine, reload_interval=0, access=AccessPolicy(api_key=KEY)), base_url=LOCAL)


def _good_request_still_works(client) -> None:
    answer = client.post("/vectorize", json={"texts": ["one red circle"], "images": []})
    assert answer.status_code == 200 and len(answer.json()["textVectors"]) == 1


def test_vectors_are_the_models_own_in_the_modules_shapes(client, tiny_checkpoint, photos) -> None:
    model = vlfit.load(str(tiny_checkpoint))
    # An object's text and image fields together, as the module's Object() sends them
    body = client.post("/vectorize", json={"texts": TEXTS, "images": [_b64(p) for p in photos]})
    assert body.status_code == 200 and body.headers["content-type"] == "application/json"
    answer = body.json()
    assert set(answer) == {"textVectors", "imageVectors"}
    np.testing.assert_allclose(np.array(answer["textVectors"]), model.encode_texts(TEXTS), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array(answer["imageVectors"]), model.encode_images(photos), rtol=0, atol=1e-6)
    # Texts() for nearText: texts and an empty image list; VectorizeImage() for nearImage: the other way round
    texts_only = client.post("/vectorize", json={"texts": TEXTS[:1], "images": []}).json()
    assert texts_only["imageVectors"] == []
    np.testing.assert_allclose(texts_only["textVectors"], model.encode_texts(TEXTS[:1]), rtol=0, atol=1e-6)
    image_only = client.post("/vectorize", json={"texts": [], "images": [_b64(photos[3])]}).json()
    assert image_only["textVectors"] == []
    np.testing.assert_allclose(image_only["imageVectors"], model.encode_images(photos[3:]), rtol=0, atol=1e-6)
    # Go marshals a nil list as null, and sends its JSON without a Content-Type
    untyped = client.post("/vectorize", content=json.dumps({"texts": TEXTS[:1], "images": None}).encode())
    assert untyped.status_code == 200 and untyped.json() == texts_only


def test_meta_answers_the_models_identity(client, engine) -> None:
    meta = client.get("/meta")
    assert meta.status_code == 200
    model = meta.json()["model"]
    identity = engine.snapshot.manifest.identity  # what the index was built with
    assert (model["family"], model["embedding_size"], model["checkpoint_sha256"]) == (
        identity.family,
        identity.embedding_size,
        identity.checkpoint_sha256,
    )
    assert model["name"] == "model" and model["image_size"] == engine.encoder.spec.image_size  # no server path
    assert meta.json()["protocol"] == "multi2vec-clip"


def test_live_and_ready_answer_204_without_a_key(engine) -> None:
    with _keyed(engine) as keyed:
        for path in ("/.well-known/live", "/.well-known/ready"):
            answer = keyed.get(path)
            assert answer.status_code == 204 and answer.content == b""
            assert keyed.head(path).status_code == 204


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"texts": "one red circle"}, 422, "texts: Input should be a valid list"),
        ({"texts": ["a", 3]}, 422, "texts.1: Input should be a valid string"),
        ({"images": [b"x".hex(), None]}, 422, "images.1: Input should be a valid string"),
        ({"texts": ["a"], "vectors": [1]}, 422, "vectors: Extra inputs are not permitted"),
        ({"texts": ["a"] * (MAX_VECTORIZE_ITEMS - 1), "images": ["AAAA", "AAAA"]}, 422, "over the limit of 64 items"),
        ({"texts": ["a", "x" * 2001]}, 422, "texts[1] is 2001 characters, over the limit of 2000 (--max_text_chars)"),
        ({"texts": ["\ud800"]}, 422, "texts[0] is not valid Unicode text"),
        ({"images": [RED, "not base64!"]}, 400, "images[1] is not base64"),
        ({"images": ["AAA"]}, 400, "images[0] is base64 without its padding"),
        ({"images": [RED, _b64(b"GIF89a not really")]}, 400, "images[1] is not an image vlfit can read: "),
        ({"images": ["AAAA"]}, 400, "images[0] is not an image vlfit can read: "),
        ({"images": [RED, _b64(TRUNCATED)]}, 400, "images[1] is not an image vlfit can read: cannot decode JPEG"),
    ],
    ids=[
        "texts-not-a-list",
        "text-not-a-string",
        "image-not-a-string",
        "unknown-field",
        "too-many-items",
        "text-too-long",
        "lone-surrogate",
        "bad-base64",
        "no-padding",
        "not-an-image",
        "empty-image",
        "truncated-jpeg",
    ],  # fmt: skip
)
def test_bad_items_get_a_4xx_naming_them(client, body, status, says) -> None:
    answer = client.post("/vectorize", content=json.dumps(body), headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert says in error and "\n" not in error
    _good_request_still_works(client)


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(client) -> None:
    large = io.BytesIO()
    Image.new("RGB", (600, 400)).save(large, "PNG")  # 240,000 pixels; the client's server takes 200,000
    answer = client.post("/vectorize", json={"images": [_b64(large.getvalue())]})
    assert answer.status_code == 422
    assert answer.json()["error"].startswith("images[0]: the image is 600x400") and "--max_query_pixels" in answer.text
    _good_request_still_works(client)


def test_malformed_json_and_other_bodies_are_refused(client) -> None:
    assert client.post("/vectorize", content=b"{not json").status_code == 422
    assert client.post("/vectorize", content='{"texts": ["a"]}'.encode("utf-16")).status_code == 400
    latin_1 = {"content-type": "application/json; charset=latin-1"}
    latin = client.post("/vectorize", content=b'{"texts": []}', headers=latin_1)
    assert latin.status_code == 415
    _good_request_still_works(client)


def test_vectorize_and_meta_need_the_key_weaviate_sends_as_basic_credentials(engine) -> None:
    with _keyed(engine) as keyed:
        body = {"texts": ["one red circle"], "images": []}
        refused = keyed.post("/vectorize", json=body)
        assert refused.status_code == 401 and "API key" in refused.json()["error"]
        assert keyed.get("/meta").status_code == 401
        # Go's http.Client turns http://weaviate:KEY@host:port into this header
        basic = {"Authorization": "Basic " + _b64(f"weaviate:{KEY}".encode())}
        assert keyed.post("/vectorize", json=body, headers=basic).status_code == 200
        assert keyed.get("/meta", headers=basic).status_code == 200
        wrong = {"Authorization": "Basic " + _b64(b"weaviate:wrong")}
        assert keyed.post("/vectorize", json=body, headers=wrong).status_code == 401
        assert keyed.post("/vectorize", json=body, headers={"Authorization": "Basic %%%"}).status_code == 401
        # Only /vectorize takes a body without a Content-Type, and no route a browser's cross-site form post
        untyped = keyed.post("/api/search", content=b'{"text": "a", "k": 1}', headers=basic)
        assert untyped.status_code == 415
        form = keyed.post("/vectorize", content=b'{"texts": []}', headers={**basic, "content-type": "text/plain"})
        assert form.status_code == 415


def test_vectorize_requests_are_counted_by_route_and_stage(client, photos) -> None:
    assert client.post("/vectorize", json={"texts": ["a"], "images": [_b64(photos[0])]}).status_code == 200
    assert client.post("/vectorize", json={"texts": 1}).status_code == 422
    metrics = client.get("/metrics").text
    assert 'vlfit_requests_total{route="/vectorize",status="200"}' in metrics
    assert 'vlfit_requests_total{route="/vectorize",status="422"}' in metrics
    assert 'vlfit_stage_seconds_count{stage="decode"}' in metrics


def test_a_full_vectorize_queue_is_refused_503_and_searches_still_admitted(engine) -> None:
    with TestClient(create_app(engine, reload_interval=0)) as fresh:
        admission = fresh.app.state.admission
        admission.service_time("vectorize").observe(0, 0.5)  # a vectorize request alone took 0.5 s
        tickets = [admission.enter("vectorize") for _ in range(40)]  # 20 s of them ahead; budget 10 x 0.5 s
        try:
            refused = fresh.post("/vectorize", json={"texts": ["a"]})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "a vectorize query would wait about" in refused.json()["error"]
            assert fresh.post("/api/search", json={"text": "one red circle", "k": 2}).status_code == 200
        finally:
            for ticket in tickets:
                ticket.answered = False
                admission.leave(ticket)
        assert fresh.post("/vectorize", json={"texts": ["a"]}).status_code == 200
        assert 'vlfit_refused_total{limit="wait"} 1.0' in fresh.get("/metrics").text


def test_a_vectorize_request_that_fails_on_the_server_gets_a_500_with_only_a_reference(engine, caplog) -> None:
    class Breaking(SearchEngine):
        def encode_texts(self, texts, times=None):
            raise RuntimeError(f"the tokenizer broke reading {PRIVATE_PATH}")

    breaking = Breaking.__new__(Breaking)
    breaking.__dict__.update(engine.__dict__)
    with TestClient(create_app(breaking, reload_interval=0)) as fresh:
        assert_internal_error(fresh.post("/vectorize", json={"texts": ["a"]}), caplog)


def test_an_image_that_does_not_decode_is_refused_with_the_decoders_reason_whatever_it_named_it(engine) -> None:
    """The item's reason comes from the decoder's error as a field, not by cutting the name it gave the image out
    of its message: an engine that names its query images otherwise still answers the reason alone."""

    class Naming(SearchEngine):
        def encode_image(self, image, times=None):
            decode_scaled(image, 32, sample_id="the uploaded query")
            return super().encode_image(image, times)

    naming = Naming.__new__(Naming)
    naming.__dict__.update(engine.__dict__)
    with pytest.raises(DecodeError) as raised:
        decode_scaled(TRUNCATED, 32, sample_id="x")
    with pytest.raises(ItemRefused) as refused:  # its header reads (the pixel check passes), its pixels do not
        vectorize(naming, [], [_PNG.getvalue(), TRUNCATED], 1_000_000, StageTimes())
    assert refused.value.status == 400 and raised.value.reason.startswith("cannot decode JPEG")
    assert str(refused.value) == f"images[1] is not an image vlfit can read: {raised.value.reason}"
