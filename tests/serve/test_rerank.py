"""Re-ranking in ``vlfit serve`` (the real app and engine in-process): ``"rerank": K`` gives the library's re-ranked
hits, a batch mixes queries with and without it, ``/api/health`` says whether the server can re-rank, and every
request it cannot answer is refused alone with a good query answered after it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import vlfit
from vlfit.index.job import IndexJob, index_collection
from vlfit.serve.app import create_app
from vlfit.serve.engine import MAX_RERANK, SearchEngine

QUERY = "a red circle"


def _index(model, image_folder, folder) -> str:
    index_collection(IndexJob(str(model), str(folder), images=str(image_folder), progress=False, index_type="flat"))
    return str(folder)


@pytest.fixture(scope="module")
def itm_served(itm_checkpoint, image_folder, tmp_path_factory) -> str:
    return _index(itm_checkpoint, image_folder, tmp_path_factory.mktemp("itm-served") / "index")


def test_a_rerank_query_gets_the_librarys_reranked_hits_beside_plain_ones(itm_served) -> None:
    engine = SearchEngine(itm_served)
    with TestClient(create_app(engine, reload_interval=0)) as client:
        assert client.get("/api/health").json()["rerank"] is True
        answered = client.post("/api/search", json={"text": QUERY, "k": 4, "rerank": 6}).json()["results"]
        metrics = client.get("/metrics").text
    library = vlfit.Index.open(itm_served).search(QUERY, k=4, rerank=6)
    assert [(hit["id"], hit["row"]) for hit in answered] == [(hit.id, hit.row) for hit in library]
    assert [hit["match_score"] for hit in answered] == pytest.approx([hit.match_score for hit in library], abs=1e-5)
    assert 'vlfit_stage_seconds_count{stage="rerank"} 1.0' in metrics  # the matching head's time, its own stage

    # One batch, two queries: the one that asks is re-ranked, the other is the plain search's.
    texts = [QUERY, "two blue squares"]
    batch = engine.search(engine.encode_texts(texts), 4, texts, [6, None])
    assert all("match_score" in hit for hit in batch[0])
    assert batch[1] == engine.search(engine.encode_texts(texts[1:]), 4)[0]


def test_rerank_requests_it_cannot_answer_are_refused_alone(itm_served, tiny_checkpoint, image_folder, tmp_path):
    plain = SearchEngine(_index(tiny_checkpoint, image_folder, tmp_path / "plain"))
    with TestClient(create_app(plain, reload_interval=0)) as client:
        assert client.get("/api/health").json()["rerank"] is False
        refused = client.post("/api/search", json={"text": QUERY, "rerank": 3})
        assert refused.status_code == 400 and "no image-text matching head" in refused.json()["error"]
        assert client.post("/api/search", json={"text": QUERY, "k": 2}).status_code == 200
    with TestClient(create_app(SearchEngine(itm_served), reload_interval=0)) as client:
        for body, status, says in [
            ({"text": QUERY, "rerank": 0}, 400, f"between 1 and {MAX_RERANK}"),
            ({"text": QUERY, "rerank": MAX_RERANK + 1}, 400, f"between 1 and {MAX_RERANK}"),
            ({"text": QUERY, "rerank": True}, 422, "rerank"),
            ({"image": "aGVsbG8=", "rerank": 3}, 422, "re-ranks text queries"),
        ]:
            answer = client.post("/api/search", json=body)
            assert answer.status_code == status and says in answer.json()["error"], answer.json()
        assert client.post("/api/search", json={"text": QUERY, "k": 2, "rerank": 2}).status_code == 200


def test_the_server_reranks_with_the_runs_saved_weight_unless_told_otherwise(weighted_itm_checkpoint, image_folder,
                                                                            tmp_path) -> None:  # fmt: skip
    weighted = _index(weighted_itm_checkpoint, image_folder, tmp_path / "weighted")
    engine = SearchEngine(weighted)
    texts = [QUERY, QUERY]
    fused, by_itm = engine.search(engine.encode_texts(texts), 6, texts, [6, 6], scores=[
        engine.check_rerank(6), engine.check_rerank(6, "itm")])  # fmt: skip
    assert all(hit["fused_score"] == pytest.approx(hit["match_score"] + 4.0 * hit["score"], abs=1e-5)
               for hit in fused)  # fmt: skip
    assert all("fused_score" not in hit for hit in by_itm)
    library = vlfit.Index.open(weighted).search(QUERY, k=6, rerank=6)
    assert [hit["id"] for hit in fused] == [hit.id for hit in library]
    with TestClient(create_app(engine, reload_interval=0)) as client:
        health = client.get("/api/health").json()
        assert (health["rerank_score"], health["rerank_weight"]) == ("itm+itc", 4.0)
        answered = client.post("/api/search", json={"text": QUERY, "k": 6, "rerank": 6}).json()["results"]
        assert [hit["fused_score"] for hit in answered] == pytest.approx(
            [hit["fused_score"] for hit in fused], abs=1e-4
        )  # a batch of one, not two
        for body, status, says in [
            ({"text": QUERY, "rerank": 6, "rerank_score": "cosine"}, 422, "rerank_score"),
            ({"text": QUERY, "rerank_score": "itm"}, 400, 'add "rerank"'),
            ({"image": "aGVsbG8=", "rerank_score": "itm"}, 422, "re-ranks text queries"),
        ]:
            answer = client.post("/api/search", json=body)
            assert answer.status_code == status and says in answer.json()["error"], answer.json()
    # --rerank_score itm on the server: a query that does not say is re-ranked by the head alone.
    plain = SearchEngine(weighted, rerank_score="itm")
    (hits,) = plain.search(plain.encode_texts([QUERY]), 6, [QUERY], [6])
    assert all("fused_score" not in hit for hit in hits)
    assert (plain.description["rerank_score"], plain.description["rerank_weight"]) == ("itm", None)


def test_fused_reranking_a_server_has_no_weight_for_is_refused_in_one_line(itm_served) -> None:
    with pytest.raises(vlfit.ConfigError, match=r"^--rerank_score itm\+itc needs a weight"):
        SearchEngine(itm_served, rerank_score="itm+itc")
    with pytest.raises(vlfit.ConfigError, match=r"^--rerank_weight must be a finite number >= 0"):
        SearchEngine(itm_served, rerank_weight=-1.0)
    with TestClient(create_app(SearchEngine(itm_served), reload_interval=0)) as client:
        refused = client.post("/api/search", json={"text": QUERY, "rerank": 3, "rerank_score": "itm+itc"})
        assert refused.status_code == 400 and "needs a weight and this server has none" in refused.json()["error"]
    with TestClient(create_app(SearchEngine(itm_served, rerank_weight=2.0), reload_interval=0)) as client:
        hits = client.post("/api/search", json={"text": QUERY, "rerank": 3}).json()["results"]
        assert hits[0]["fused_score"] == pytest.approx(hits[0]["match_score"] + 2.0 * hits[0]["score"], abs=1e-5)
