"""Re-ranking an index's results by the matching head: only the top K change order, each by the log-odds the pair
scorer gives its (query, image) pair, the same through ``vlfit retrieve query`` and ``vlfit.Index.search``; asked of
a model without a head, of image queries or of embeddings, one line each."""

from __future__ import annotations

import json

import pytest
import torch

import vlfit
from vlfit.cli import main
from vlfit.data.image_transforms import FastImageTransform, stack_images
from vlfit.index.job import IndexJob, index_collection
from vlfit.inference.pair_scorer import pair_scorer_for
from vlfit.inference.runtime import ModelRuntime

QUERY = "a red circle"


@pytest.fixture(scope="module")
def itm_index(itm_checkpoint, image_folder, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("itm-index") / "index")
    index_collection(IndexJob(str(itm_checkpoint), out, images=str(image_folder), progress=False, index_type="flat"))
    return out


@pytest.fixture(scope="module")
def weighted_index(weighted_itm_checkpoint, image_folder, tmp_path_factory) -> str:
    """An index of a model whose run saved a re-ranking weight (4.0)."""
    out = str(tmp_path_factory.mktemp("weighted-index") / "index")
    index_collection(IndexJob(str(weighted_itm_checkpoint), out, images=str(image_folder), progress=False,
                              index_type="flat"))  # fmt: skip
    return out


def _json_hits(capsys, *argv: str) -> list[dict]:
    capsys.readouterr()
    assert main(["retrieve", "query", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["queries"][0]["results"]


def test_reranking_reorders_only_the_top_k_by_each_pairs_matching_score(
    itm_index, itm_checkpoint, image_folder, capsys
) -> None:
    cosine = _json_hits(capsys, "--index", itm_index, "--text", QUERY, "-k", "8")
    reranked = _json_hits(capsys, "--index", itm_index, "--text", QUERY, "-k", "8", "--rerank_top_k", "5")
    assert {hit["id"] for hit in reranked[:5]} == {hit["id"] for hit in cosine[:5]}
    assert reranked[5:] == cosine[5:]  # beyond K: cosine order, no match score
    scores = [hit["match_score"] for hit in reranked[:5]]
    assert scores == sorted(scores, reverse=True)

    # Each score is the pair scorer's for (query, that image file), computed here on its own.
    scorer = pair_scorer_for(ModelRuntime.open(str(itm_checkpoint)).encoder)
    transform = FastImageTransform(scorer.spec.image_size)
    pixels = stack_images([transform((image_folder / hit["id"]).read_bytes()) for hit in reranked[:5]])
    expected = scorer.score_pairs([QUERY] * 5, pixels)
    assert torch.tensor(scores) == pytest.approx(expected, abs=1e-5)

    library = vlfit.Index.open(itm_index).search(QUERY, k=8, rerank=5)
    assert [(hit.id, hit.match_score) for hit in library] == [(h["id"], h.get("match_score")) for h in reranked]
    assert [hit.id for hit in vlfit.Index.open(itm_index).search(QUERY, k=3, rerank=5)] == [
        hit["id"] for hit in reranked[:3]
    ]  # K candidates re-scored, k kept


def test_fused_reranking_orders_by_the_log_odds_plus_the_weight_times_the_cosine(itm_index, capsys) -> None:
    query = ["--index", itm_index, "--text", QUERY, "-k", "8", "--rerank_top_k", "8"]
    cosine = _json_hits(capsys, "--index", itm_index, "--text", QUERY, "-k", "8")
    itm = _json_hits(capsys, *query, "--rerank_score", "itm")
    assert all("fused_score" not in hit for hit in itm)
    fused = _json_hits(capsys, *query, "--rerank_score", "itm+itc", "--rerank_weight", "2.5")
    for hit in fused:
        assert hit["fused_score"] == pytest.approx(hit["match_score"] + 2.5 * hit["score"], abs=1e-5)
    assert [hit["fused_score"] for hit in fused] == sorted((hit["fused_score"] for hit in fused), reverse=True)
    # Weight 0 is the matching head's order; a very large weight, the cosine's.
    at_zero = _json_hits(capsys, *query, "--rerank_score", "itm+itc", "--rerank_weight", "0")
    assert [hit["id"] for hit in at_zero] == [hit["id"] for hit in itm]
    at_large = _json_hits(capsys, *query, "--rerank_score", "itm+itc", "--rerank_weight", "1e9")
    assert [hit["id"] for hit in at_large] == [hit["id"] for hit in cosine]
    assert [hit["id"] for hit in itm] != [hit["id"] for hit in cosine]  # the head reorders: the ends differ


def test_the_runs_saved_weight_is_what_retrieve_query_and_the_library_rerank_with(
    weighted_index, weighted_itm_checkpoint, capsys
) -> None:
    query = ["--index", weighted_index, "--text", QUERY, "-k", "6", "--rerank_top_k", "6"]
    default = _json_hits(capsys, *query)
    assert all(hit["fused_score"] == pytest.approx(hit["match_score"] + 4.0 * hit["score"], abs=1e-5)
               for hit in default)  # fmt: skip
    assert default == _json_hits(capsys, *query, "--rerank_score", "itm+itc", "--rerank_weight", "4")
    assert all("fused_score" not in hit for hit in _json_hits(capsys, *query, "--rerank_score", "itm"))
    assert vlfit.load(str(weighted_itm_checkpoint)).rerank_weight == 4.0
    library = vlfit.Index.open(weighted_index).search(QUERY, k=6, rerank=6)
    assert [(hit.id, hit.fused_score) for hit in library] == [(hit["id"], hit["fused_score"]) for hit in default]
    itm = vlfit.Index.open(weighted_index).search(QUERY, k=6, rerank=6, rerank_score="itm")
    assert all(hit.fused_score is None for hit in itm)


@pytest.mark.slow
def test_timing_reports_the_reranking_apart(itm_index, capsys) -> None:
    capsys.readouterr()
    assert main(["retrieve", "query", "--index", itm_index, "--text", QUERY, "--rerank_top_k", "3", "--json",
                 "--timing"]) == 0  # fmt: skip
    timing = json.loads(capsys.readouterr().out)["timing"]
    assert list(timing) == ["open", "encode", "search", "rerank", "total"]
    stages = sum(ms for stage, ms in timing.items() if stage != "total")
    assert timing["rerank"] > 0 and stages <= timing["total"] + 0.003  # each figure rounded to the microsecond


def test_reranking_that_cannot_run_is_one_line(itm_index, image_folder, tiny_checkpoint, tmp_path, capsys) -> None:
    plain = str(tmp_path / "plain")
    index_collection(IndexJob(str(tiny_checkpoint), plain, images=str(image_folder), progress=False,
                              index_type="flat"))  # fmt: skip
    cases = [
        (["--index", plain, "--text", QUERY, "--rerank_top_k", "3"], "has no image-text matching head; re-ranking"),
        (["--index", itm_index, "--image", str(next(image_folder.rglob("*.jpg"))), "--rerank_top_k", "3"],
         "--rerank_top_k re-ranks text queries"),
        (["--index", itm_index, "--text", QUERY, "--rerank_top_k", "0"],
         "--rerank_top_k 0 is out of range: give at least 1"),
        (["--index", itm_index, "--text", QUERY, "--rerank_top_k", "3", "--rerank_weight", "nan"],
         "--rerank_weight must be a finite number >= 0"),
        (["--index", itm_index, "--text", QUERY, "--rerank_top_k", "3", "--rerank_score", "itm+itc"],
         "--rerank_score itm+itc needs a weight"),
        (["--index", itm_index, "--text", QUERY, "--rerank_weight", "2"], "add --rerank_top_k K"),
    ]  # fmt: skip
    for argv, expected in cases:
        capsys.readouterr()
        assert main(["retrieve", "query", *argv]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith("vlfit retrieve: error: ") and expected in errors[0], errors
    index = vlfit.Index.open(itm_index)
    with pytest.raises(vlfit.ConfigError, match="pass the query texts, not embeddings"):
        index.search(index.model.encode_texts([QUERY]), rerank=3)
    with pytest.raises(vlfit.ConfigError, match=r"`rerank=` must be a whole number"):
        index.search(QUERY, rerank=-1)
    with pytest.raises(vlfit.ConfigError, match=r"^`rerank_score=` must be itm or itm\+itc, got 'cosine'$"):
        index.search(QUERY, rerank=3, rerank_score="cosine")
