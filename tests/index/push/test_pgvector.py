"""PostgreSQL with pgvector: a search answers every hit asked for, also beyond what an HNSW scan can return, and
needs no more than reading (the push, not the search, makes the extension)."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.index.push.conftest import target_uri, write_synthetic_index
from vlfit.index.push.base import TargetError, open_target
from vlfit.index.push.job import push_index
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
