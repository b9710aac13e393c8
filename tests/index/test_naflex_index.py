"""A SigLIP 2 NaFlex run through the index and the server: photos of any shape are embedded at the run's token
budget by ``vlfit retrieve index``, found by themselves through ``vlfit.Index.search`` and the server's image search,
with the embeddings ``vlfit.load`` gives."""

from __future__ import annotations

import base64
import json
import re
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


def test_an_index_keeps_the_patch_budget_it_was_built_with_for_queries_and_appends(naflex_index, tmp_path, capsys):
    model, images, _ = naflex_index
    index = tmp_path / "index"
    main(["retrieve", "index", "--model", str(model), "--images", str(images), "--output_dir", str(index),
          "--max_num_patches", "6"])  # fmt: skip
    files = sorted(images.iterdir())
    at_six = vlfit.load(str(model), max_num_patches=6).encode_images(files)
    at_twelve = vlfit.load(str(model)).encode_images(files)
    assert (at_six * at_twelve).sum(1).min() < 0.9999  # the budget changes the embeddings: which one is used matters

    # Queries: retrieve query, vlfit.Index and the server embed at the index's 6 without being told.
    capsys.readouterr()
    assert main(["retrieve", "query", "--index", str(index), "--image", str(files[0]), "-k", "1", "--json"]) == 0
    (hit,) = json.loads(capsys.readouterr().out)["queries"][0]["results"]
    assert hit["score"] == pytest.approx(1.0, abs=1e-4)
    assert vlfit.Index.open(str(index)).model.runtime.inputs.max_num_patches == 6
    assert SearchEngine(str(index)).runtime.inputs.max_num_patches == 6

    # Appends: at the index's budget by default; another budget is refused in one line naming the flag.
    (images / "late.jpg").write_bytes(files[0].read_bytes()[:-2] + b"\xff\xd9")  # a new file, one more item
    try:
        capsys.readouterr()
        assert main(["retrieve", "index", "--model", str(model), "--images", str(images), "--output_dir", str(index),
                     "--max_num_patches", "12"]) == 2  # fmt: skip
        refusal = capsys.readouterr().err.strip().splitlines()
        assert len(refusal) == 1 and re.search("--max_num_patches 12 is not the 6 the index .* was built with",
                                               refusal[0])  # fmt: skip
        assert main(["retrieve", "index", "--model", str(model), "--images", str(images), "--output_dir",
                     str(index)]) == 0  # fmt: skip
        opened = vlfit.Index.open(str(index))
        assert len(opened) == len(files) + 1
        late = vlfit.load(str(model), max_num_patches=6).encode_images([images / "late.jpg"])
        assert opened.search(late, k=1)[0][0].score == pytest.approx(1.0, abs=1e-4)
    finally:
        (images / "late.jpg").unlink()


def test_a_naflex_model_is_described_by_its_patch_budget_not_a_square_side(naflex_index, tiny_checkpoint, caplog):
    model, _, index = naflex_index
    loaded = vlfit.load(str(model))
    patch = loaded.runtime.inputs.patch_size
    with caplog.at_level("WARNING", logger="vlfit.models.loading"):
        assert loaded.max_num_patches == 12 and vlfit.load(str(model), max_num_patches=6).max_num_patches == 6
    assert "images are cut into at most 6 patches (--max_num_patches), not the 12" in caplog.text  # said, not hidden
    assert loaded.runtime.inputs.image_input == f"at most 12 patches of {patch} px"  # the training log's words
    assert vlfit.load(str(tiny_checkpoint)).max_num_patches is None
    with TestClient(create_app(SearchEngine(str(index)), reload_interval=0)) as client:
        meta = client.get("/meta").json()["model"]
    assert (meta["max_num_patches"], meta["patch_size"]) == (12, patch) and "image_size" not in meta
