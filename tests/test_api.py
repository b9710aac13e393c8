"""The Python API: docs/python-api.md's example runs as written, and each function keeps its contract."""

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vlfit

PYTHON_API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def _python_example() -> str:
    """The Python API page's example (its first ``python`` block); tests/test_docs.py runs the other examples."""
    text = PYTHON_API_PAGE.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_the_readme_example_runs(synthetic_dataset_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "data").symlink_to(synthetic_dataset_dir)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(_python_example(), "docs/python-api.md", "exec"), namespace)
    run, model, index = namespace["run"], namespace["model"], namespace["index"]
    assert run.output_dir == "runs/python" and (tmp_path / "runs/python/model.safetensors").is_file()
    assert 0.0 <= run.metrics["eval_t2i_recall@1"] <= 1.0 and run.metrics["train_loss"] > 0
    assert len(index) == 8 and isinstance(model, vlfit.Model)
    card = (tmp_path / "runs/python/README.md").read_text()
    assert card.startswith("---\n") and "vlfit.train(model_preset='clip-tiny'" in card and "eval_t2i_recall@1" in card
    assert "runs/python" in capsys.readouterr().out


def test_public_names_are_the_documented_ones():
    assert set(vlfit.__all__) >= {"load", "train", "evaluate", "Index", "Model", "UserError", "__version__"}
    for name in vlfit.__all__:
        assert getattr(vlfit, name) is not None


@pytest.fixture(scope="module")
def preset_model():
    return vlfit.load("clip-tiny")


def test_every_image_kind_gives_the_same_normalized_embedding(preset_model, tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (72, 90, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    path = tmp_path / "image.png"
    path.write_bytes(png.getvalue())
    embeddings = preset_model.encode_images([str(path), png.getvalue(), Image.fromarray(pixels), pixels])
    assert embeddings.shape == (4, preset_model.embedding_dim) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(embeddings, np.repeat(embeddings[:1], 4, axis=0), atol=1e-5)  # PNG is lossless
    texts = preset_model.encode_texts(["a red square", "two blue circles"])
    np.testing.assert_allclose(preset_model.similarity(pixels, ["a red square", "two blue circles"]),
                               embeddings[:1] @ texts.T, atol=1e-5)  # fmt: skip


def test_a_models_threads_are_its_own_and_a_second_load_runs_on_the_default():
    import torch

    before = torch.get_num_threads()
    seen: list[int] = []
    for num_threads in (before + 1, None):
        model = vlfit.load("clip-tiny", num_threads=num_threads)
        assert torch.get_num_threads() == before
        model.encoder.text_tower.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        model.encode_texts(["a red square"])
        assert torch.get_num_threads() == before
    assert seen == [before + 1, before]


def test_bad_images_name_their_position(preset_model, tmp_path):
    good = np.zeros((32, 32, 3), dtype=np.uint8)
    with pytest.raises(vlfit.MissingFileError, match=r"images\[1\] \(.*nope.jpg\): no such file"):
        preset_model.encode_images([good, str(tmp_path / "nope.jpg")])
    with pytest.raises(vlfit.DataError, match=r"images\[2\]"):
        preset_model.encode_images([good, good, b"not an image"])
    with pytest.raises(vlfit.DataError, match=r"images\[0\]: a numpy image must be uint8"):
        preset_model.encode_images([good.astype(np.float32)])


def test_a_text_that_is_not_valid_unicode_names_its_position(preset_model):
    """A lone surrogate reached the tokenizer, whose TypeError said nothing of the text; the server answers it 422
    with the same words (vlfit.data.text_checks)."""
    message = ("texts[1] is not valid Unicode text: a lone surrogate (U+D800, half of a UTF-16 pair) at character 2, "
               "which no tokenizer takes")  # fmt: skip
    with pytest.raises(vlfit.DataError) as refused:
        preset_model.encode_texts(["a red square", "x \ud800 y"])
    assert str(refused.value) == message
    with pytest.raises(vlfit.DataError, match=r"^texts\[0\] is not valid Unicode text: a lone surrogate \(U\+DCFF"):
        preset_model.similarity(np.zeros((32, 32, 3), dtype=np.uint8), "\udcff")  # a file name that is not UTF-8


def test_errors_name_keyword_arguments_not_flags(tmp_path):
    with pytest.raises(vlfit.ConfigError, match=r"^`lora_r=` must be at least 1, got 0$"):
        vlfit.train(model_preset="clip-tiny", lora_r=0, output_dir=str(tmp_path))
    with pytest.raises(vlfit.ArgumentError, match=r"`learning_rat=` \(did you mean `learning_rate=`\?\)"):
        vlfit.train(model_preset="clip-tiny", learning_rat=1e-3, output_dir=str(tmp_path))


@pytest.fixture(scope="module")
def trained_model(tiny_checkpoint):
    """A saved model (a preset's weights are drawn again at each load, so an index of one is refused)."""
    return vlfit.load(str(tiny_checkpoint))


def test_an_index_is_built_opened_appended_to_and_searched(trained_model, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{name}.png")
    index = vlfit.Index.build(trained_model, str(tmp_path / "index"), images=str(folder))
    assert len(index) == 2
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / "c.png")
    reopened = vlfit.Index.open(str(tmp_path / "index"), trained_model)
    assert reopened.append() == 1 and len(reopened) == 3
    assert reopened.append() == 0  # nothing new in the folder
    query = trained_model.encode_images(str(folder / "c.png"))
    (hits,) = reopened.search(query, k=2)
    assert hits[0].id == "c.png" and hits[0].path == str(folder / "c.png")
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert len(reopened.search("a red square", k=3)) == 3


def test_an_append_builds_as_the_index_was_built(trained_model, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(2)
    for name in ("a", "b", "c"):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{name}.png")
    settings = {"index_type": "hnsw", "max_index_memory": 10**7, "target_recall": 0.9, "shard_size": 2}
    index = vlfit.Index.build(trained_model, str(tmp_path / "index"), images=str(folder), **settings)
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / "d.png")
    assert index.append() == 1
    manifest = json.loads((tmp_path / "index" / "index_manifest.json").read_text())
    recorded = {**settings, "vector_storage": "float32", "rescore": None}  # and the defaults of those not given
    assert [entry["settings"] for entry in manifest["collections"]] == [recorded, recorded]
    assert manifest["ann"]["type"] == "hnsw" and manifest["ann"]["max_index_memory"] == 10**7  # not auto's flat
