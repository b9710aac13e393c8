"""A SigLIP 2 NaFlex run through the index and the server: photos of any shape are embedded at the run's token
budget by ``vlfit retrieve index``, found by themselves through ``vlfit.Index.search`` and the server's image search,
with the embeddings ``vlfit.load`` gives."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

import vlfit
from tests.models.test_siglip2 import CAPTIONS, PHOTOS
from vlfit.cli import main
from vlfit.models.loading import load_model
from vlfit.serve.app import create_app
from vlfit.serve.engine import SearchEngine


@pytest.fixture(scope="module")
def naflex_index(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("naflex")
    torch.manual_seed(0)
    model = root / "model"
    load_model(model_preset="siglip2-tiny", captions=lambda: CAPTIONS, max_num_patches=12).save(str(model))
    images = root / "images"
    images.mkdir()
    for index, make in enumerate(PHOTOS.values()):
        (images / f"{index}.jpg").write_bytes(make())
    index = root / "index"
    assert main(["retrieve", "index", "--model", str(model), "--images", str(images), "--output_dir", str(index)]) == 0
    return model, images, index


def test_every_photo_finds_itself_in_the_index_with_the_embedding_vlfit_load_gives(naflex_index):
    model, images, index = naflex_index
    files = sorted(images.iterdir())
    opened = vlfit.Index.open(str(index))
    direct = vlfit.load(str(model)).encode_images(files)
    assert np.linalg.norm(direct, axis=1) == pytest.approx(1.0, abs=1e-5)
    for path, (hit,) in zip(files, opened.search(direct, k=1), strict=True):
        assert hit.id == path.name
        assert hit.score == pytest.approx(1.0, abs=1e-4)  # the index holds what vlfit.load embeds


def test_the_server_finds_a_photo_by_its_bytes(naflex_index):
    _, images, index = naflex_index
    tall = sorted(images.iterdir())[0]
    with TestClient(create_app(SearchEngine(str(index)), reload_interval=0)) as client:
        answer = client.post("/api/search", json={"image": base64.b64encode(tall.read_bytes()).decode(), "k": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"][0]["item"] == tall.name
