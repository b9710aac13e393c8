"""Weaviate's multi2vec-clip module against a real ``vlfit serve`` process on loopback: its readiness wait, its
vectorize requests as its Go client sends them (JSON without a Content-Type, the key as the password of the URL it
is given), the meta it reads, and the metrics they are counted in."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

import vlfit

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
REQUEST_TIMEOUT = 30
API_KEY = "weaviate-module-key-0123456789"


@pytest.fixture(scope="module")
def checkpoint_and_server(tiny_checkpoint: Path, synthetic_dataset_dir: str, tmp_path_factory):
    from vlfit.serve.launch import kill_process_tree, start_server

    folder = tmp_path_factory.mktemp("weaviate-server")
    vlfit.Index.build(str(tiny_checkpoint), str(folder / "index"), dataset_name=synthetic_dataset_dir,
                      split="validation")  # fmt: skip
    server = start_server(["--index", str(folder / "index")], str(folder / "server.log"), timeout=START_TIMEOUT,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLFIT_API_KEY": API_KEY})  # fmt: skip
    try:
        yield tiny_checkpoint, server
    finally:
        kill_process_tree(server.process)


def _as_go_sends(base: str, body: dict) -> httpx.Response:
    """A POST /vectorize as Weaviate's module client makes it: json.Marshal'ed, no Content-Type, and the key of
    CLIP_INFERENCE_API=http://weaviate:KEY@host:port as Basic credentials (httpx, like Go, sends a URL's)."""
    origin = base.replace("http://", f"http://weaviate:{API_KEY}@")
    content = json.dumps(body, separators=(",", ":")).encode()
    return httpx.post(f"{origin}/vectorize", content=content, timeout=REQUEST_TIMEOUT)


def test_the_module_waits_vectorizes_and_reads_meta(checkpoint_and_server, synthetic_dataset_dir) -> None:
    from vlfit.data.sources import open_splits

    checkpoint, server = checkpoint_and_server
    # WaitForStartup: GET /.well-known/ready with no header, a 2xx (within 500 ms, on a quiet machine)
    ready = httpx.get(f"{server.url}/.well-known/ready", timeout=REQUEST_TIMEOUT)
    assert ready.status_code == 204
    assert httpx.get(f"{server.url}/.well-known/live", timeout=REQUEST_TIMEOUT).status_code == 204

    images = [open_splits(dataset_name=synthetic_dataset_dir)["test"][i].image for i in range(2)]
    texts = ["one red circle", "a green cross"]
    answer = _as_go_sends(server.url, {"texts": texts, "images": [base64.b64encode(i).decode() for i in images]})
    assert answer.status_code == 200
    vectors = answer.json()
    model = vlfit.load(str(checkpoint))
    np.testing.assert_allclose(vectors["textVectors"], model.encode_texts(texts), rtol=0, atol=1e-6)
    np.testing.assert_allclose(vectors["imageVectors"], model.encode_images(images), rtol=0, atol=1e-6)

    meta = httpx.get(f"{server.url}/meta", auth=("weaviate", API_KEY), timeout=REQUEST_TIMEOUT)
    assert meta.status_code == 200 and meta.json()["model"]["embedding_size"] == len(vectors["textVectors"][0])
    assert httpx.get(f"{server.url}/meta", timeout=REQUEST_TIMEOUT).status_code == 401


def test_a_bad_item_is_the_modules_error_and_the_server_serves_on(checkpoint_and_server) -> None:
    _, server = checkpoint_and_server
    refused = _as_go_sends(server.url, {"texts": ["a"], "images": ["not base64!"]})
    assert refused.status_code == 400  # the client reports "fail with status 400: " and the "error" field
    assert refused.json()["error"].startswith("images[0] is not base64")
    assert _as_go_sends(server.url, {"texts": ["a"], "images": []}).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", auth=("weaviate", API_KEY), timeout=REQUEST_TIMEOUT).text
    assert 'vlfit_requests_total{route="/vectorize",status="400"} 1.0' in metrics
    assert 'vlfit_requests_total{route="/.well-known/ready",status="204"}' in metrics
