"""Smaller vectors at the same recall: a chosen embedding size at every door (``--embedding_dim``: the first d
dimensions, L2-normalized again, cut where embeddings leave the encoder), and int8 or binary codes re-scored with the
float32 vectors the shards keep (``--vector_storage``, ``--rescore``)."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

import vlfit
from vlfit.errors import ConfigError
from vlfit.index.ann import AnnIndex, build_ann, recall_at_k
from vlfit.index.ann_choice import storage_choice
from vlfit.index.job import IndexJob
from vlfit.index.search import query_runtime, search
from vlfit.index.store import EmbeddingIndex
from vlfit.index.verify import verify_index
from vlfit.inference.identity import RefusedModelError
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.models.input_spec_file import save_input_settings

SIZE = 16
TEXTS = ["a red circle on the left", "two blue squares"]


def _cut(full: np.ndarray, size: int = SIZE) -> np.ndarray:
    """What every door must give: the full embedding's first ``size`` dimensions, L2-normalized again."""
    return full[:, :size] / np.linalg.norm(full[:, :size], axis=1, keepdims=True)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    cosines = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert np.allclose(cosines, 1.0, atol=1e-6), cosines


def _clustered(rng: np.random.Generator, centers: np.ndarray, count: int) -> np.ndarray:
    x = centers[rng.integers(0, len(centers), count)] + 0.5 * rng.standard_normal((count, centers.shape[1]))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_every_door_cuts_embeddings_as_load_does(synthetic_dataset_dir, tmp_path, caplog) -> None:
    """vlfit.load, an index build and its queries (retrieve index/query's engine), serve's engine: all give the full
    embedding's first d dimensions renormalized, and the index records d for its queries."""
    from tests.inference.tiny_models import save_tiny_checkpoint, write_image_folder
    from vlfit.serve.engine import SearchEngine

    model = str(save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "model"))
    images = write_image_folder(synthetic_dataset_dir, tmp_path / "photos")
    full = vlfit.load(model)
    with caplog.at_level(logging.INFO, logger="vlfit.inference.embedding_dim"):
        small = vlfit.load(model, embedding_dim=SIZE)
    assert "not trained to stand alone" in caplog.text  # an ordinary run: its full size only
    assert small.embedding_dim == SIZE
    _same(small.encode_texts(TEXTS), _cut(full.encode_texts(TEXTS)))
    photos = sorted(str(p) for p in images.glob("validation/*.jpg"))[:3]
    _same(small.encode_images(photos), _cut(full.encode_images(photos)))

    folder = str(tmp_path / "index")
    vlfit.Index.build(model, folder, images=str(images), embedding_dim=SIZE, vector_storage="int8", rescore=2)
    manifest = json.loads((tmp_path / "index" / "index_manifest.json").read_text())
    assert manifest["model"]["embedding_dim"] == SIZE and manifest["identity"]["embedding_size"] == SIZE
    assert manifest["ann"]["type"] == "int8" and manifest["ann"]["rerank"] == 2
    index = EmbeddingIndex(folder)
    stored = index.embeddings().numpy()
    by_id = dict(zip(index.row_ids, stored, strict=True))
    _same(np.stack([by_id[p] for p in photos]), _cut(full.encode_images(photos)))
    queries = query_runtime(index).embed_texts(TEXTS)  # the index's size, filled in from its manifest
    _same(queries.numpy(), _cut(full.encode_texts(TEXTS)))
    hits = search(index, queries, 5)
    exact = search(index, queries, 5, exact=True)
    assert [[h.id for h in row] for row in hits] == [[h.id for h in row] for row in exact]
    _same(SearchEngine(folder).encode_texts(TEXTS).numpy(), _cut(full.encode_texts(TEXTS)))

    with pytest.raises(ConfigError, match="--embedding_dim 8: the index .* holds embeddings of size 16"):
        query_runtime(index, settings=RuntimeSettings(embedding_dim=8))
    with pytest.raises(ConfigError, match="--embedding_dim 8: the index"):
        IndexJob(model, folder, images=str(images), runtime=RuntimeSettings(embedding_dim=8)).replayed(index)
    appended = IndexJob(model, folder, images=str(images)).replayed(index)
    assert appended.runtime.embedding_dim == SIZE  # appends cut alike

    trained = dataclasses.replace(full.runtime.inputs, matryoshka_dims=(SIZE,))  # a Matryoshka run's record
    save_input_settings(trained, model)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vlfit.inference.embedding_dim"):
        _same(vlfit.load(model, embedding_dim=SIZE).encode_texts(TEXTS), _cut(full.encode_texts(TEXTS)))
    assert "not trained to stand alone" not in caplog.text


def test_an_export_is_cut_as_its_full_embedding(onnx_export) -> None:
    """An export's graphs output the full size; the runtime cuts what they give (one place, every format)."""
    full = vlfit.load(onnx_export, precision="fp32")
    small = vlfit.load(onnx_export, precision="fp32", embedding_dim=SIZE)
    _same(small.encode_texts(TEXTS), _cut(full.encode_texts(TEXTS)))


def test_sizes_out_of_range_are_refused_in_one_line() -> None:
    from vlfit.arguments.sizes import check_size

    with pytest.raises(ConfigError, match="--embedding_dim 0 is out of range: give at least 1"):
        check_size("embedding_dim", 0)
    with pytest.raises(ConfigError, match="--embedding_dim must be at least 1"):
        RuntimeSettings(embedding_dim=0)
    with pytest.raises(RefusedModelError, match="more than the 64 dimensions"):
        vlfit.load("clip-tiny", embedding_dim=65)
    with pytest.raises(ConfigError, match="--index_type hnsw is for float32 vectors"):
        IndexJob("m", "out", images="x", vector_storage="binary", index_type="hnsw")
    with pytest.raises(ConfigError, match="unknown --vector_storage 'int4'"):
        storage_choice(10, 8, "int4")
    with pytest.raises(ConfigError, match="--rescore must be at least 1"):
        IndexJob("m", "out", images="x", rescore=0)


@pytest.mark.parametrize(("storage", "least", "size"), [("int8", 0.99, 256), ("binary", 0.97, 32)])
def test_compact_codes_rescored_find_the_exact_top_10(storage, least, size, tmp_path) -> None:
    """int8 and binary codes with the top 4 x k re-scored from the float32 vectors find what exact float32 search
    finds (clustered data), at a quarter and a thirty-second of the bytes, saved and read back alike."""
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((20, 256))
    vectors, queries = _clustered(rng, centers, 600), _clustered(rng, centers, 50)
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :10]
    ann = build_ann(vectors, storage=storage, rescore=4)
    assert (ann.rerank, ann.description["rescore_tuned"]) == (4, False)  # as asked, not tuned
    scores, rows = ann.search(queries, 10)
    assert recall_at_k(rows, exact) >= least
    assert np.allclose(scores, np.take_along_axis(queries @ vectors.T, rows, axis=1), atol=1e-5)  # exact cosines
    assert ann.description["bytes_per_vector"] < size + 4  # the codes (and SQ8 ranges) as the ANN's memory figure
    ann.save(str(tmp_path))
    again = AnnIndex.load(str(tmp_path), vectors=vectors)
    assert (again.search(queries, 10)[1] == rows).all()
    assert rows[0, 0] not in again.search(queries[:1], 10, exclude=[rows[0, 0]])[1]


def test_verify_checks_the_codes_file(synthetic_dataset_dir, tmp_path) -> None:
    from tests.inference.tiny_models import save_tiny_checkpoint, write_image_folder

    model = str(save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "model"))
    images = write_image_folder(synthetic_dataset_dir, tmp_path / "photos")
    folder = tmp_path / "index"
    vlfit.Index.build(model, str(folder), images=str(images), vector_storage="binary")
    assert verify_index(str(folder), "full").whole
    codes = folder / "ann.faiss"
    data = bytearray(codes.read_bytes())
    data[-1] ^= 0xFF
    codes.write_bytes(bytes(data))
    assert not verify_index(str(folder), "full").whole


def test_a_push_keeps_compact_codes_where_the_engine_has_them(tmp_path) -> None:
    """Qdrant's collection is created with the quantization of the index's storage; an engine without one here sends
    float32 vectors and the report says so in one line."""
    from qdrant_client import models

    from tests.index.push.conftest import write_synthetic_index
    from vlfit.index.push.job import push_index
    from vlfit.index.push.qdrant import quantization

    folder = tmp_path / "index"
    write_synthetic_index(folder, 20)
    manifest_file = folder / "index_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["collections"][-1]["settings"] = {"vector_storage": "binary", "rescore": 4}
    manifest_file.write_text(json.dumps(manifest))
    index = EmbeddingIndex(str(folder))
    qdrant = push_index(index, f"qdrant:{tmp_path / 'qdrant'}")
    assert qdrant.pushed == 20 and qdrant.lines()[-1].endswith("binary codes as Qdrant's binary quantization (for a "
                                                                "collection it creates)")  # fmt: skip
    assert isinstance(quantization("binary"), models.BinaryQuantization)
    assert quantization("int8").scalar.type == models.ScalarType.INT8 and quantization("float32") is None
    lance = push_index(index, f"lancedb:{tmp_path / 'lance'}")
    assert lance.lines()[-1].endswith("no binary form used for this engine: the push sends float32 vectors")
    assert lance.to_dict()["storage"].startswith("no binary form")


def test_a_new_index_tunes_its_rescoring_to_the_target_unless_told(tmp_path) -> None:
    """Without --rescore, compact codes re-score the smallest factor of their storage's (binary: 32, 64, 128, 256)
    whose recall@10 reaches --target_recall: sign bits of many crowded vectors need more than 32 candidates a result
    (10^6 clustered vectors needed 128, benchmarks/smaller_vectors.py). --rescore fixes the factor."""
    rng = np.random.default_rng(0)
    scale = (np.arange(24) + 1.0) ** -0.5  # spread falling along the dimensions, as in benchmarks/smaller_vectors.py
    vectors = (rng.standard_normal(24) + 0.7 * rng.standard_normal((1000, 24))) * scale  # one crowded cluster
    tuned = build_ann(vectors / np.linalg.norm(vectors, axis=1, keepdims=True), storage="binary").describe()
    assert tuned["rescore_tuned"] and tuned["reached_target"] and tuned["recall_at_10"] >= 0.95
    assert tuned["rerank"] in (64, 128, 256)  # 32 (tried first) fell short: x32 keeps recall@10 0.82 here

    def rescore(**flags) -> int | None:
        return IndexJob("m", str(tmp_path / "new"), images="x", **flags).replayed(None).rescore

    assert (rescore(vector_storage="binary"), rescore(vector_storage="binary", rescore=6)) == (None, 6)
