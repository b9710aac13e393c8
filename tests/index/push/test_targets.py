"""Each vector database, on its real embedded engine: a push writes every item once, resumes after a stop, writes
nothing for an unchanged index, deletes what the index no longer holds, searches as the local index does, and refuses
in one line what it cannot take."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.index.push.conftest import mark_removed, write_synthetic_index
from vlfit.errors import DataError
from vlfit.index.integrity import DamagedIndexError
from vlfit.index.push.base import TargetError, open_target
from vlfit.index.push.job import index_record, push_index
from vlfit.index.push.pushed import PushedIndex
from vlfit.index.search import search
from vlfit.index.store import EmbeddingIndex
from vlfit.index.verify import verify_index

BATCH = 128


class Stop(Exception):
    """The push killed part-way."""


def _engine_ids(uri: str) -> tuple[int, set[str]]:
    """How many items the collection holds, and their distinct ids."""
    target = open_target(uri)
    assert target.record() is not None
    return target.count(), target.ids()


def test_a_push_stopped_part_way_resumes_to_every_item_once(uri, synthetic_index, monkeypatch) -> None:
    folder, ids = synthetic_index
    index = EmbeddingIndex(str(folder))
    engine = type(open_target(uri))
    write = engine.write
    calls = []

    def stop_after_three(self, items, *, new):
        if len(calls) == 3:
            raise Stop
        calls.append(len(items))
        write(self, items, new=new)

    monkeypatch.setattr(engine, "write", stop_after_three)
    with pytest.raises(Stop):
        push_index(index, uri, batch_size=BATCH)
    assert _engine_ids(uri)[0] == 3 * BATCH

    monkeypatch.setattr(engine, "write", write)
    report = push_index(index, uri, batch_size=BATCH)
    assert (report.created, report.skipped, report.pushed, report.total) == (False, 3 * BATCH, 1000 - 3 * BATCH, 1000)
    count, found = _engine_ids(uri)
    assert count == 1000 and found == set(ids)  # no duplicates, none missing


def test_a_push_of_an_unchanged_index_writes_nothing_unless_told_to_overwrite(uri, synthetic_index, monkeypatch):
    folder, ids = synthetic_index
    index = EmbeddingIndex(str(folder))
    assert push_index(index, uri, batch_size=250).pushed == 1000
    written = []
    engine = type(open_target(uri))
    write = engine.write
    monkeypatch.setattr(engine, "write", lambda self, items, *, new: written.append(len(items)))
    report = push_index(index, uri, batch_size=250)
    assert (report.pushed, report.skipped, report.total, written) == (0, 1000, 1000, [])

    monkeypatch.setattr(engine, "write", lambda self, items, *, new: written.append(new) or write(self, items, new=new))
    report = push_index(index, uri, batch_size=250, overwrite=True)
    assert report.pushed == 1000 and written == [False] * 4  # upserts: the items were there
    assert _engine_ids(uri) == (1000, set(ids))


def test_delete_missing_removes_the_items_the_index_no_longer_holds(uri, tmp_path) -> None:
    folder = tmp_path / "index"
    ids = write_synthetic_index(folder, 300)
    push_index(EmbeddingIndex(str(folder)), uri)
    mark_removed(folder, ids[:40])  # gone from their folder since

    kept = push_index(EmbeddingIndex(str(folder)), uri)
    assert (kept.pushed, kept.deleted, kept.total) == (0, 0, 300)  # without the flag nothing is removed
    report = push_index(EmbeddingIndex(str(folder)), uri, delete_missing=True)
    assert (report.pushed, report.deleted, report.total) == (0, 40, 260)
    assert _engine_ids(uri) == (260, set(ids[40:]))


def test_a_pushed_collection_answers_as_the_local_index_does(uri, synthetic_index) -> None:
    folder, _ = synthetic_index
    index = EmbeddingIndex(str(folder))
    push_index(index, uri, batch_size=500)
    generator = torch.Generator().manual_seed(7)
    queries = torch.nn.functional.normalize(torch.randn(5, 16, generator=generator), dim=1)

    local = search(index, queries, 10, exact=True)
    pushed = PushedIndex(uri).search(queries, 10, exact=True)
    assert [[hit.id for hit in hits] for hits in pushed] == [[hit.id for hit in hits] for hits in local]
    for hits, expected in zip(pushed, local, strict=True):
        assert [(hit.row, hit.captions) for hit in hits] == [(hit.row, hit.captions) for hit in expected]
        np.testing.assert_allclose([hit.score for hit in hits], [hit.score for hit in expected], atol=1e-5)


def test_a_push_from_another_model_or_size_is_refused_in_one_line(uri, tmp_path, synthetic_index) -> None:
    small = tmp_path / "small"
    write_synthetic_index(small, 20)
    push_index(EmbeddingIndex(str(small)), uri)
    for name, kwargs, expected in [
        ("other", {"source": "preset:other"}, "holds embeddings of the preset:tiny, the index of the preset:other"),
        ("wider", {"dim": 8}, "holds tiny embeddings of size 16, the index tiny embeddings of size 8; push it to"),
    ]:
        write_synthetic_index(tmp_path / name, 20, **kwargs)
        with pytest.raises(TargetError) as refused:
            push_index(EmbeddingIndex(str(tmp_path / name)), uri)
        message = str(refused.value)
        assert message.startswith(uri) and expected in message and "\n" not in message
    assert _engine_ids(uri)[0] == 20  # nothing written


def _foreign_collection(uri: str) -> None:
    """A collection named as the URI's, made by the engine's own client, not by a push."""
    target = open_target(uri)
    engine, name = target.uri.scheme, target.uri.collection
    if engine == "lancedb":
        target.db.create_table(name, data=[{"vector": [0.0, 1.0], "label": "x"}])
    elif engine == "qdrant":
        from qdrant_client import models

        target.client.create_collection(name, vectors_config=models.VectorParams(size=2, distance=models.Distance.DOT))
    elif engine == "chroma":
        target.client.create_collection(name)
    elif engine == "postgresql":
        target.connection.execute(f'CREATE TABLE "{name}" (label text)')
    else:
        target.client.create_collection(name, dimension=2)


def test_a_collection_not_written_by_a_push_is_refused_in_one_line(uri, tmp_path) -> None:
    _foreign_collection(uri)
    write_synthetic_index(tmp_path / "index", 20)
    with pytest.raises(TargetError) as refused:
        push_index(EmbeddingIndex(str(tmp_path / "index")), uri)
    message = str(refused.value)
    assert message.startswith(uri) and "was not written by vlfit retrieve push" in message and "\n" not in message
    with pytest.raises(TargetError, match="was not written by vlfit retrieve push"):
        PushedIndex(uri)


def test_searching_a_collection_never_pushed_says_how_to_push_one(uri) -> None:
    with pytest.raises(TargetError, match=r"no collection 'items\w*' there; push an index to it first: vlfit retri"):
        PushedIndex(uri)


@pytest.mark.slow
def test_the_collection_lasts_beyond_the_process_that_pushed_it(tmp_path) -> None:
    """What another process reads back: the record and the items (the local files closed, then opened again)."""
    import subprocess
    import sys

    from vlfit.index.push.base import close_shared_clients

    write_synthetic_index(tmp_path / "index", 50)
    engines = ("lancedb", "qdrant", "chroma", "milvus")
    uris = [f"{engine}:{tmp_path / engine}{'.db' if engine == 'milvus' else ''}#items" for engine in engines]
    for uri in uris:
        push_index(EmbeddingIndex(str(tmp_path / "index")), uri)
    close_shared_clients(str(tmp_path))
    code = ("import sys; from vlfit.index.push.pushed import PushedIndex\n"
            "for uri in sys.argv[1:]:\n"
            "    p = PushedIndex(uri); print(len(p), p.record.identity.checkpoint_sha256)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *uris], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split() for line in done.stdout.splitlines()] == [["50", "preset:tiny"]] * len(engines)


def test_a_push_writes_in_batches_of_the_engines_bulk_size(uri, synthetic_index, monkeypatch) -> None:
    folder, _ = synthetic_index
    engine = type(open_target(uri))
    monkeypatch.setattr(engine, "BATCH_SIZE", 300)
    write = engine.write
    sizes = []
    monkeypatch.setattr(
        engine, "write", lambda self, items, *, new: sizes.append(len(items)) or write(self, items, new=new)
    )
    push_index(EmbeddingIndex(str(folder)), uri)
    assert sizes == [300, 300, 300, 100]


def test_postgresql_builds_the_hnsw_index_once_the_rows_are_written(request, tmp_path) -> None:
    from tests.index.push.conftest import target_uri

    uri = target_uri("pgvector", tmp_path, request)
    write_synthetic_index(tmp_path / "index", 50)
    target = open_target(uri)
    indexes = "SELECT indexdef FROM pg_indexes WHERE tablename = %s"
    target.create(index_record(EmbeddingIndex(str(tmp_path / "index"))))
    assert [d for (d,) in target.connection.execute(indexes, (target.uri.collection,))] == [
        f"CREATE UNIQUE INDEX {target.uri.collection}_pkey ON public.{target.uri.collection} USING btree (id)"
    ]  # the new table: no HNSW index while the first push writes
    push_index(EmbeddingIndex(str(tmp_path / "index")), uri)
    found = [d for (d,) in target.connection.execute(indexes, (target.uri.collection,))]
    assert any("USING hnsw (embedding vector_cosine_ops)" in d for d in found), found


def test_two_items_pushed_under_one_id_are_refused_before_anything_is_written(uri, tmp_path) -> None:
    """Two indexed folders with an ``x.jpg`` each: both would be pushed as ``x.jpg``, so no engine may take the push
    (one would fail on its key, one keep both, one keep the last)."""
    first, second = tmp_path / "photos" / "2023", tmp_path / "photos" / "2024"
    ids = [f"{first}/x.jpg", f"{first}/y.jpg", f"{second}/x.jpg"]
    folder = tmp_path / "index"
    write_synthetic_index(folder, 3, ids=ids, images=[str(first), str(second)])
    with pytest.raises(DataError) as refused:
        push_index(EmbeddingIndex(str(folder)), uri)
    message = str(refused.value)
    assert f"two items would be pushed under one id, 'x.jpg': {first}/x.jpg and {second}/x.jpg" in message
    assert message.startswith(f"--index {folder}: ") and "\n" not in message
    assert open_target(uri).record() is None  # nothing written, not even the collection

    mark_removed(folder, ids[2:])  # left out of the index's searches: not pushed, so no longer in the way
    report = push_index(EmbeddingIndex(str(folder)), uri)
    assert (report.pushed, report.total) == (2, 2) and _engine_ids(uri) == (2, {"x.jpg", "y.jpg"})


def _damage(file: Path, value: float) -> None:
    """Write ``value`` over the last embedding value of a shard file, its size unchanged."""
    data = bytearray(file.read_bytes())
    data[-4:] = np.float32(value).tobytes()
    file.write_bytes(bytes(data))


def test_a_damaged_shard_of_the_same_size_is_refused_before_its_items_are_written(tmp_path) -> None:
    """A push reads the shards it writes: a shard whose bytes differ from the manifest's checksum (or, in an index
    that records none, whose embeddings are not finite) is refused in one line naming it and the rebuild, as
    vlfit retrieve verify words it, and none of its items is written."""
    folder = tmp_path / "index"
    ids = write_synthetic_index(folder, 600, shard_size=300)
    manifest_file = folder / "index_manifest.json"
    shard = json.loads(manifest_file.read_text())["shards"][1]
    embeddings = folder / shard["embeddings"]
    _damage(embeddings, 0.5)
    uri = f"lancedb:{tmp_path / 'lance'}"
    with pytest.raises(DamagedIndexError) as refused:
        push_index(EmbeddingIndex(str(folder)), uri, batch_size=BATCH)
    message = str(refused.value)
    verified = verify_index(str(folder), "full").problems[0].line
    assert message == verified and "\n" not in message
    assert message.startswith(f"{embeddings}: checksum ") and "; rebuild it: vlfit retrieve index " in message
    assert message.endswith("--verify full")
    assert _engine_ids(uri)[1].isdisjoint(ids[300:])

    manifest = json.loads(manifest_file.read_text())  # an index written before checksums were recorded
    for each in manifest["shards"]:
        each.pop("files", None)
    manifest_file.write_text(json.dumps(manifest))
    _damage(embeddings, float("nan"))
    with pytest.raises(DamagedIndexError, match=r"1 of 300 embeddings hold NaN or infinite values; rebuild it"):
        push_index(EmbeddingIndex(str(folder)), uri, batch_size=BATCH)
    assert _engine_ids(uri)[1].isdisjoint(ids[300:])
