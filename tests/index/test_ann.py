"""vlfit.index.ann: the structure chosen per collection size and memory budget, each reaching its recall target
against exact search, IVF-PQ within its budget, save/load (memory-mapped), appends, and the missing-extra error."""

import sys

import faiss
import numpy as np
import pytest
import torch

from vlfit.errors import ConfigError, MissingExtraError
from vlfit.index.ann import AnnIndex, build_ann, recall_at_k
from vlfit.index.ann_choice import FLAT_THRESHOLD, MIN_IVFPQ_VECTORS, choose_index_type, ivf_lists, ivfpq_fixed_bytes

GiB = 2**30


def _unit(rows: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :k]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These tests share a few cores with other work, where faiss's OpenMP threads spin and run slower than one.
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def ivfpq():
    """An IVF-PQ index of 10,000 vectors of size 8 (the fewest its 256-centroid codebooks train on), budgeted to
    8-byte codes."""
    vectors = _unit(MIN_IVFPQ_VECTORS + 16, 8, seed=0)
    budget = 260_000
    return vectors, budget, build_ann(vectors, "ivfpq", budget, target_recall=0.9)


def test_auto_follows_autofaiss_rules_without_faiss(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # the rule is arithmetic: it never imports faiss
    assert choose_index_type(FLAT_THRESHOLD - 1, 512, 4 * GiB).type == "flat"
    hnsw = choose_index_type(1_000_000, 512, 4 * GiB)
    assert (hnsw.type, hnsw.factory, hnsw.params) == ("hnsw", "HNSW32", {"M": 32})
    assert 512 * 4 < hnsw.bytes_per_vector < 512 * 4 + 400  # the vector plus its links

    # Past what HNSW fits: IVF over ~4 sqrt(N) lists found through HNSW, the largest PQ code that fits and divides D.
    tight = choose_index_type(1_000_000, 512, GiB)
    assert tight.factory == "IVF4000_HNSW32,PQ64x8" and tight.params == {"nlist": 4000, "m": 64, "nbits": 8}
    huge = choose_index_type(100_000_000, 768, 4 * GiB)
    assert huge.type == "ivfpq" and huge.params["nlist"] == 40_000 and huge.params["m"] == 32
    assert huge.bytes_per_vector * 100_000_000 <= 4 * GiB < (48 + 8) * 100_000_000
    assert 768 % huge.params["m"] == 0

    # A small collection whose flat vectors do not fit goes to IVF-PQ, with lists of at least 39 training points.
    small = choose_index_type(20_000, 64, 1_000_000)
    assert small.type == "ivfpq" and small.params["nlist"] == ivf_lists(20_000) == 20_000 // 39
    assert small.bytes_per_vector * 20_000 <= 1_000_000
    assert choose_index_type(20_000, 64, 10 * GiB, "hnsw").type == "hnsw"

    with pytest.raises(ConfigError, match=r"--max_index_memory 100000 is too small for 20000 vectors"):
        choose_index_type(20_000, 64, 100_000)
    with pytest.raises(ConfigError, match=r"--index_type hnsw needs about \d+ bytes for 20000 vectors"):
        choose_index_type(20_000, 64, 1_000_000, "hnsw")
    with pytest.raises(ConfigError, match=r"ivfpq needs at least 9984 vectors"):
        choose_index_type(5_000, 64, GiB, "ivfpq")
    with pytest.raises(ConfigError, match=r"unknown --index_type 'lsh'"):
        choose_index_type(5_000, 64, GiB, "lsh")


def test_flat_equals_exact_search_and_leaves_out_excluded_rows():
    vectors, queries = _unit(3000, 32, seed=1), _unit(20, 32, seed=2)
    ann = build_ann(vectors, "auto")
    assert ann.type == "flat" and ann.describe()["recall_at_10"] == 1.0
    scores, rows = ann.search(queries, 10)
    np.testing.assert_array_equal(rows, _exact_top(vectors, queries, 10))
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ vectors.T, rows, axis=1), atol=1e-5)

    excluded = rows[:, 0]
    _, kept = ann.search(queries, 10, exclude=excluded)
    assert not set(kept.ravel().tolist()) & set(excluded.tolist())
    np.testing.assert_array_equal(kept[:, 0], np.where(np.isin(rows[:, 1], excluded), kept[:, 0], rows[:, 1]))


def test_hnsw_reaches_its_target_recall_against_exact_search():
    vectors, queries = _unit(5000, 32, seed=3), _unit(200, 32, seed=4)
    ann = build_ann(vectors, "hnsw", target_recall=0.95)
    described = ann.describe()
    assert described["reached_target"] and described["recall_at_10"] >= 0.95
    assert described["search_params"]["efSearch"] >= 16 and described["trained_on"] == 5000
    # Queries from outside the index are harder (an indexed vector is its own first neighbour), yet close.
    assert recall_at_k(ann.search(queries, 10)[1], _exact_top(vectors, queries, 10)) >= 0.85
    assert 32 * 4 < described["bytes_per_vector"] < 32 * 4 + 400
    assert described["query_latency_ms"] > 0


@pytest.mark.slow
def test_ivfpq_reaches_its_target_within_its_memory_budget(ivfpq):
    vectors, budget, ann = ivfpq
    described = ann.describe()
    assert described["factory"] == "IVF256_HNSW32,PQ8x8"
    assert described["reached_target"] and described["recall_at_10"] >= 0.9
    assert 1 <= described["search_params"]["nprobe"] < 256  # tuned, not scanning every list
    assert described["bytes_per_vector"] * len(vectors) <= budget
    assert described["bytes_per_vector"] < 4 * 8  # smaller than the float32 vectors themselves
    queries = _unit(200, 8, seed=5)
    assert recall_at_k(ann.search(queries, 10)[1], _exact_top(vectors, queries, 10)) >= 0.85


@pytest.mark.parametrize("kind", ["hnsw", "ivfpq"])
def test_a_saved_index_loads_memory_mapped_with_the_same_results(kind, ivfpq, tmp_path):
    vectors, _, ann = ivfpq if kind == "ivfpq" else (_unit(2000, 16, seed=6), None, None)
    ann = ann or build_ann(vectors, "hnsw")
    saved = ann.save(str(tmp_path))
    loaded = AnnIndex.load(str(tmp_path), mmap=True)
    assert saved["file"] == "ann.faiss" and loaded.describe()["search_params"] == ann.describe()["search_params"]
    queries = vectors[:50]
    for got, want in zip(loaded.search(queries, 10), ann.search(queries, 10), strict=True):
        np.testing.assert_array_equal(got, want)


def test_added_vectors_are_found_and_ivf_asks_for_retraining_past_4x(ivfpq):
    vectors = _unit(2000, 16, seed=7)
    ann = build_ann(vectors, "hnsw")
    added = _unit(100, 16, seed=8)
    ann.add(added)
    _, rows = ann.search(added, 1)
    assert (rows[:, 0] == np.arange(2000, 2100)).mean() >= 0.98

    trained, _, index = ivfpq
    extra = _unit(3 * len(trained), 8, seed=9)
    index = AnnIndex(faiss.clone_index(index.index), dict(index.description))
    index.add(extra)
    assert not index.needs_retrain  # 4x what it trained on: still fine
    _, rows = index.search(extra[:50], 10)
    assert np.mean([len(trained) + i in row for i, row in enumerate(rows)]) >= 0.9
    index.add(extra[:1])
    assert index.needs_retrain and index.describe()["needs_retrain"]


def test_without_faiss_building_stops_with_the_serve_extra_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(MissingExtraError) as error:
        build_ann(_unit(10, 4, seed=0))
    assert (
        str(error.value)
        == "vlfit retrieve index needs the serve extra (faiss not installed): pip install 'vlfit[serve]'"
    )


def _clustered(rows: int, dim: int, seed: int, centres: int = 100) -> np.ndarray:
    rng = np.random.default_rng(seed)
    means = _unit(centres, dim, seed=99)  # the same mixture for every seed
    x = means[rng.integers(centres, size=rows)] + 0.4 / np.sqrt(dim) * rng.standard_normal((rows, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.slow
def test_coarse_pq_codes_are_re_ranked_from_the_shards_to_reach_the_target(tmp_path, monkeypatch):
    from vlfit.index import ann as ann_module
    from vlfit.index.ann_update import open_ann, update_ann
    from vlfit.index.store import EmbeddingIndex, write_index_from_embeddings
    from vlfit.inference.identity import ModelIdentity

    n, dim = MIN_IVFPQ_VECTORS + 2000, 32
    vectors, queries = _clustered(n, dim, seed=10), _clustered(200, dim, seed=11)
    identity, model = ModelIdentity("clip", dim, "0" * 64), {"path": "m", "backend": "torch", "precision": "fp32"}
    ids = [f"v{i}" for i in range(n)]
    write_index_from_embeddings(str(tmp_path), identity, model, ids, torch.from_numpy(vectors), collection={},
                                shard_size=5000)  # fmt: skip
    index = EmbeddingIndex(str(tmp_path))
    rows = np.array([n - 1, 0, 5000, 4999, 0, 7321])  # across the three shards, repeats and any order
    np.testing.assert_array_equal(index.vectors()[rows], vectors[rows])

    monkeypatch.setattr(ann_module, "TUNING_QUERIES", 300)  # three builds below: tuning on fewer queries
    budget = ivfpq_fixed_bytes(dim, ivf_lists(n)) + n * (4 + 8) + 1000  # room for 4-byte codes only
    described = update_ann(str(tmp_path), index_type="ivfpq", max_index_memory=budget, target_recall=0.9)
    assert described["factory"].endswith(",PQ4x8") and described["bytes_per_vector"] * n <= budget
    assert described["reached_target"] and described["rerank"] > 1

    ann = open_ann(EmbeddingIndex(str(tmp_path)))  # the manifest now names it
    scores, found = ann.search(queries, 10)
    exact = _exact_top(vectors, queries, 10)
    assert recall_at_k(found, exact) >= 0.85
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ vectors.T, found, axis=1), atol=1e-5)
    # The codes alone rank far worse: re-ranking is what reaches the target.
    codes_only = AnnIndex(ann.index, {**ann.description, "rerank": 1})
    assert recall_at_k(codes_only.search(queries, 10)[1], exact) < 0.8

    with pytest.raises(ConfigError, match="re-ranks its candidates with the full vectors: open it with"):
        AnnIndex.load(str(tmp_path)).search(queries, 10)

    # A larger budget asks for larger codes: the structure is rebuilt; asked again, it is left as it is.
    larger = ivfpq_fixed_bytes(dim, ivf_lists(n)) + n * (8 + 8) + 1000
    rebuilt = update_ann(str(tmp_path), index_type="ivfpq", max_index_memory=larger, target_recall=0.9)
    assert rebuilt["factory"].endswith(",PQ8x8") and not rebuilt["extended"]
    stamp = (tmp_path / "ann.faiss").stat().st_mtime_ns
    again = update_ann(str(tmp_path), index_type="ivfpq", max_index_memory=larger, target_recall=0.9)
    assert again == {key: value for key, value in rebuilt.items() if key != "extended"}
    assert (tmp_path / "ann.faiss").stat().st_mtime_ns == stamp
