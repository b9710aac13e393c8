"""OpenAI's embeddings API against a real ``vlfit serve`` process on loopback (one for the module, with a key): texts
through the ``openai`` client itself (floats and its default, base64), images as Jina's API sends them (bare base64
and ``data:`` URLs, mixed with texts) through raw requests, vectors equal to ``vlfit.load``'s, ``usage`` counted by
the tokenizer, and errors in OpenAI's shape with its status codes, the key's and the body limit's included."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import vlfit

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
REQUEST_TIMEOUT = 30
API_KEY = "openai-route-key-0123456789"
TEXTS = ["one red circle", "two blue squares and a green cross on the left"]


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, synthetic_dataset_dir: str, tmp_path_factory):
    """``(checkpoint, server, model id)``: a server of an index built with ``tiny_checkpoint``, its bodies bounded
    at 1 MB."""
    from vlfit.serve.launch import kill_process_tree, start_server

    folder = tmp_path_factory.mktemp("openai-server")
    vlfit.Index.build(str(tiny_checkpoint), str(folder / "index"), dataset_name=synthetic_dataset_dir,
                      split="validation")  # fmt: skip
    server = start_server(["--index", str(folder / "index"), "--max_upload_mb", "1"], str(folder / "server.log"),
                          timeout=START_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                                      "VLFIT_API_KEY": API_KEY})  # fmt: skip
    try:
        yield tiny_checkpoint, server, tiny_checkpoint.name
    finally:
        kill_process_tree(server.process)


@pytest.fixture(scope="module")
def model(served):
    return vlfit.load(str(served[0]))


@pytest.fixture(scope="module")
def photos(synthetic_dataset_dir) -> list[bytes]:
    """Two JPEGs of the dataset (not square) and a PNG of 301x173 pixels."""
    from vlfit.data.sources import open_splits

    test = open_splits(dataset_name=synthetic_dataset_dir)["test"]
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (173, 301, 3), dtype=np.uint8)).save(png, "PNG")
    return [test[0].image, test[1].image, png.getvalue()]


def _client(server, key: str = API_KEY):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT)


def _post(server, body: object, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/embeddings", json=body, headers=headers, timeout=REQUEST_TIMEOUT, **kwargs)


def _least_cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def _openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    """The message of an error answered in OpenAI's shape, with ``status``, ``param`` and ``code``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ("invalid_request_error" if status < 429 else "requests" if status == 429 else
                             "server_error")  # fmt: skip
    assert (error["param"], error["code"]) == (param, code), error
    return error["message"]


def test_the_openai_client_embeds_texts_as_vlfit_load(served, model) -> None:
    _, server, name = served
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [name]

    expected = model.encode_texts(TEXTS)
    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64 and decodes it
    for answer in (floats, packed):
        assert [item.index for item in answer.data] == [0, 1] and answer.model == name
        vectors = [item.embedding for item in answer.data]
        assert len(vectors[0]) == expected.shape[1]
        assert _least_cosine(vectors, expected) >= 0.99999
    tokenizer = model.runtime.inputs.tokenizer
    tokens = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)  # special tokens included, none cut
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    one = client.embeddings.create(model=name, input=TEXTS[0], dimensions=expected.shape[1], encoding_format="float")
    assert _least_cosine([one.data[0].embedding], expected[:1]) >= 0.99999
    cut = client.embeddings.create(model=name, input=TEXTS, dimensions=8)  # its first 8, normalised again
    prefix = torch.nn.functional.normalize(torch.as_tensor(expected[:, :8]).float(), dim=-1)
    assert all(len(item.embedding) == 8 for item in cut.data) and _least_cosine(
        [item.embedding for item in cut.data], prefix.numpy()) >= 0.99999  # fmt: skip

    import openai

    with pytest.raises(openai.NotFoundError) as refused:
        client.embeddings.create(model="text-embedding-3-small", input=TEXTS)
    assert refused.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="not-the-key").embeddings.create(model=name, input=TEXTS)


def test_the_serving_pages_example_runs(served, model) -> None:
    """docs/serving.md's Python example (``tests/test_docs.py`` leaves it to this test), pointed at this server."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
    assert "http://127.0.0.1:8000/v1" in code and 'api_key="none"' in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{served[1].url}/v1").replace('"none"', repr(API_KEY))
    names: dict = {}
    exec(compile(code, "docs/serving.md (example 1)", "exec"), names)
    assert _least_cosine(names["vectors"], model.encode_texts(["two red circles", "a green cross"])) >= 0.99999


def test_images_and_texts_mixed_as_jina_sends_them(served, model, photos) -> None:
    _, server, name = served
    jpeg, other, png = photos
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    items = [{"image": base64.b64encode(jpeg).decode()}, TEXTS[0], {"text": TEXTS[1]}, {"image": data_url},
             {"image": base64.b64encode(other).decode()}]  # fmt: skip
    answer = _post(server, {"model": name, "input": items})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(5))
    vectors = [d["embedding"] for d in body["data"]]
    assert _least_cosine([vectors[i] for i in (0, 3, 4)], model.encode_images([jpeg, png, other])) >= 0.99999
    assert _least_cosine(vectors[1:3], model.encode_texts(TEXTS)) >= 0.99999
    tokenizer = model.runtime.inputs.tokenizer
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)  # images 0

    packed = _post(server, {"model": name, "input": items[:1], "encoding_format": "base64"}).json()
    floats = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(floats, np.asarray(vectors[0], dtype=np.float32))


def test_errors_are_openais_shape_and_the_server_serves_on(served, photos) -> None:
    _, server, name = served
    good = {"model": name, "input": TEXTS}
    assert "not served here" in _openai_error(_post(server, {**good, "model": "gpt-4"}), 404, "model",
                                              "model_not_found")  # fmt: skip
    url = _post(server, {"model": name, "input": ["a", {"image": "https://example.com/cat.jpg"}]})
    assert _openai_error(url, 400, "input").startswith("input[1].image is a URL: URLs are refused")
    assert "input is empty" in _openai_error(_post(server, {"model": name, "input": []}), 400, "input")
    assert "empty string" in _openai_error(_post(server, {"model": name, "input": ""}), 400, "input")
    too_many = _post(server, {"model": name, "input": ["a caption"] * 65})
    assert "65 items, over the limit of 64" in _openai_error(too_many, 400, "input")
    tokens = _post(server, {"model": name, "input": [[101, 2023, 102]]})
    assert "token ids" in _openai_error(tokens, 400, "input")
    size = len(_post(server, good).json()["data"][0]["embedding"])
    for dimensions in (0, size + 1):
        assert f"dimensions {dimensions}" in _openai_error(_post(server, {**good, "dimensions": dimensions}), 400,
                                                           "dimensions")  # fmt: skip
    broken = _post(server, {"model": name, "input": [{"image": base64.b64encode(photos[0][:300]).decode()}]})
    assert _openai_error(broken, 400, "input").startswith("input[0] is not an image vlfit can read")
    # the JSON reader's 422s and the middlewares' answers, reshaped: a field of the wrong type, no key, a big body
    assert "encoding_format" in _openai_error(_post(server, {**good, "encoding_format": "int8"}), 400)
    missing_key = _post(server, good, key=None)
    assert "API key" in _openai_error(missing_key, 401, code="invalid_api_key")
    assert missing_key.headers["www-authenticate"] == "Bearer"
    assert _openai_error(_post(server, {**good, "input": ["x" * 1_100_000]}), 413)
    unknown = httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"},
                        timeout=REQUEST_TIMEOUT)  # fmt: skip
    _openai_error(unknown, 404)

    assert _post(server, good).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": API_KEY}, timeout=REQUEST_TIMEOUT).text
    assert 'vlfit_requests_total{route="/v1/embeddings",status="200"}' in metrics
    assert 'vlfit_requests_total{route="/v1/embeddings",status="404"}' in metrics
