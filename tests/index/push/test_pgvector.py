"""PostgreSQL with pgvector: a search answers every hit asked for, also beyond what an HNSW scan can return, and
needs no more than reading (the push, not the search, makes the extension); an index of compact codes is pushed to
pgvector's own compact forms (halfvec, binary_quantize bits), or, before pgvector 0.7, to float32 saying so."""

from __future__ import annotations

import uuid

import psycopg
import pytest
import torch
from psycopg import sql

from tests.index.push.conftest import target_uri, write_synthetic_index
from vlfit.index.push.base import TargetError, open_target
from vlfit.index.push.job import push_index
from vlfit.index.push.pgvector import PgvectorTarget
from vlfit.index.push.pushed import PushedIndex
from vlfit.index.search import search
from vlfit.index.store import EmbeddingIndex

# Every transaction read-only, as on a replica or for a role that may only read (libpq's PGOPTIONS).
READ_ONLY = "-c default_transaction_read_only=on"


def _queries(count: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(count, 16, generator=torch.Generator().manual_seed(3)), dim=1)


def test_a_search_for_more_hits_than_an_hnsw_scan_returns_answers_each_of_them(request, tmp_path, monkeypatch):
    """pgvector's HNSW scan returns at most hnsw.ef_search rows (1,000 at the most): a larger k is answered whole."""
    write_synthetic_index(tmp_path / "index", 1200, shard_size=600)
    index = EmbeddingIndex(str(tmp_path / "index"))
    uri = target_uri("pgvector", tmp_path, request)
    push_index(index, uri)
    queries = _queries(2)
    # The planner scans a table this small whole; a large one it searches through the HNSW index, as here.
    monkeypatch.setenv("PGOPTIONS", "-c enable_seqscan=off")
    for k in (1100, 1200, 5000):
        found = PushedIndex(uri).search(queries, k)
        assert [len(hits) for hits in found] == [min(k, 1200)] * 2
        expected = search(index, queries, k, exact=True)
        assert [[hit.id for hit in hits] for hits in found] == [[hit.id for hit in hits] for hits in expected]


def test_a_search_only_reads_and_the_push_makes_the_extension(request, tmp_path, monkeypatch) -> None:
    """In a database without pgvector a read-only search says there is nothing pushed; the first push makes the
    extension; searches of the pushed table then run in read-only transactions."""
    server = request.getfixturevalue("postgres_url")
    database = f"fresh_{uuid.uuid4().hex[:8]}"
    open_target(f"{server}#x").connection.execute(f'CREATE DATABASE "{database}"')
    uri = f"{server.replace('/postgres?', f'/{database}?')}#items"
    write_synthetic_index(tmp_path / "index", 30)
    index = EmbeddingIndex(str(tmp_path / "index"))

    monkeypatch.setenv("PGOPTIONS", READ_ONLY)
    with pytest.raises(TargetError, match=r"no collection 'items' there; push an index to it first"):
        PushedIndex(uri)
    monkeypatch.delenv("PGOPTIONS")
    assert push_index(index, uri).total == 30
    monkeypatch.setenv("PGOPTIONS", READ_ONLY)
    pushed = PushedIndex(uri)
    assert pushed.target.connection.execute("SHOW transaction_read_only").fetchone() == ("on",)
    found = pushed.search(_queries(3), 5)
    expected = search(index, _queries(3), 5, exact=True)
    assert [[hit.id for hit in hits] for hits in found] == [[hit.id for hit in hits] for hits in expected]


def _clustered(count: int, seed: int) -> torch.Tensor:
    """Unit vectors of size 64 around 20 centres, as embeddings are (sign bits rank uniform noise poorly)."""
    centres = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    points = centres[torch.randint(0, 20, (count,), generator=generator)] + 0.5 * torch.randn(
        count, 64, generator=generator
    )
    return torch.nn.functional.normalize(points, dim=1)


def _compact_index(folder, storage: str, rescore: int) -> EmbeddingIndex:
    settings = {"vector_storage": storage, "rescore": rescore}
    write_synthetic_index(folder, 400, dim=64, settings=settings, vectors=_clustered(400, 1))
    return EmbeddingIndex(str(folder))


def _indexes(target) -> list[str]:
    found = target.connection.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", (target.uri.collection,))
    return [definition for (definition,) in found if "USING hnsw" in definition]


FORMS = [("int8", "((embedding)::halfvec(64)) halfvec_cosine_ops"),
         ("binary", "((binary_quantize(embedding))::bit(64)) bit_hamming_ops")]  # fmt: skip


@pytest.mark.parametrize(("storage", "indexed"), FORMS)
def test_a_compact_index_is_pushed_to_pgvectors_own_form_and_searched_through_it(
    storage, indexed, request, tmp_path, monkeypatch
) -> None:
    """int8 codes: an HNSW index over halfvec; binary: over binary_quantize bits, its top rescore x k re-ranked by the
    full cosine. The planner searches through it, and the hits are the local index's exact ones."""
    uri = target_uri("pgvector", tmp_path, request)
    if not open_target(uri).compact_forms():
        pytest.skip(f"the embedded server's pgvector {open_target(uri).pgvector_version()} has no halfvec (0.7+)")
    index = _compact_index(tmp_path / "index", storage, 4)
    report = push_index(index, uri)
    assert (
        report.lines()[-1]
        == f"{uri}: {storage} codes as {PgvectorTarget.COMPACT[storage]} (for a collection it creates)"
    )
    pushed = PushedIndex(uri)
    assert [indexed in definition for definition in _indexes(pushed.target)] == [True]
    assert pushed.target.indexed() == (storage, 4)  # the index's --rescore, kept as the HNSW index's comment

    monkeypatch.setenv("PGOPTIONS", "-c enable_seqscan=off")  # the planner scans a table this small whole
    pushed = PushedIndex(uri)
    statement, candidates, scan = pushed.target.statement(10, 64)
    assert (candidates, scan) == (40 if storage == "binary" else 10, False)
    queries = _clustered(5, 2)
    with psycopg.ClientCursor(pushed.target.connection) as cursor:
        params = {"query": queries[0].numpy(), "candidates": candidates, "k": 10}
        plan = "\n".join(line for (line,) in cursor.execute(sql.SQL("EXPLAIN ") + statement, params))
    assert f"Index Scan using {pushed.target.uri.collection}_embedding_hnsw" in plan, plan
    found = pushed.search(queries, 10)
    expected = search(index, queries, 10, exact=True)
    pairs = zip(found, expected, strict=True)
    recall = [len({hit.id for hit in hits} & {hit.id for hit in best}) / 10 for hits, best in pairs]
    assert sum(recall) / len(recall) >= 0.9, recall
    assert [hits[0].id for hits in found] == [best[0].id for best in expected]
    assert found[0][0].score == pytest.approx(expected[0][0].score, abs=1e-5)  # the full cosine, not the codes'


def test_a_compact_index_on_a_pgvector_without_halfvec_keeps_float32_and_says_so(request, tmp_path, monkeypatch):
    """pgvector before 0.7 (pgserver's 0.6.2) has no halfvec or binary_quantize: the float32 index, in one line."""
    uri = target_uri("pgvector", tmp_path, request)
    version = open_target(uri).pgvector_version()
    if open_target(uri).compact_forms():  # a newer server: as one without them
        version = "0.6.2"
        monkeypatch.setattr(PgvectorTarget, "pgvector_version", lambda self: version)
    report = push_index(_compact_index(tmp_path / "index", "binary", 8), uri)
    assert report.lines()[-1] == (f"{uri}: no binary form used: the server's pgvector {version} has no halfvec or "
                                  "binary_quantize (0.7 or later has); the push sends float32 vectors and indexes "
                                  "them as they are")  # fmt: skip
    target = PushedIndex(uri).target
    assert ["USING hnsw (embedding vector_cosine_ops)" in definition for definition in _indexes(target)] == [True]
    assert target.indexed() == ("float32", 1)
