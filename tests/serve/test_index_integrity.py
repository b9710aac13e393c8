"""What ``vlfit serve`` does with an index that is not whole: refuses to start in one line naming the file and the
command that rebuilds it (``--verify quick|full``), keeps serving the previous snapshot when a reload finds damage,
answers every query when some embeddings are NaN, and survives its ANN file being overwritten in place. Each
finding is followed by a good query that must be answered."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from vlfit.cli import main
from vlfit.index.integrity import DamagedIndexError
from vlfit.index.manifest import MANIFEST_NAME, write_manifest
from vlfit.index.store import EmbeddingIndex
from vlfit.serve.app import create_app
from vlfit.serve.engine import SearchEngine

QUERY = {"text": "a red circle", "k": 5}


@pytest.fixture(scope="module")
def built_index(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory) -> Path:
    """The synthetic validation split indexed with the tiny checkpoint (exact: no ANN structure)."""
    import vlfit

    path = tmp_path_factory.mktemp("integrity") / "index"
    vlfit.Index.build(str(tiny_checkpoint), str(path), dataset_name=synthetic_dataset_dir, split="validation",
                      index_type="flat")  # fmt: skip
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest.pop("ann")
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def _copy(index: Path, folder: Path) -> Path:
    import shutil

    return Path(shutil.copytree(index, folder))


def _answered(client: TestClient) -> list[dict]:
    answer = client.post("/api/search", json=QUERY)
    assert answer.status_code == 200, answer.text
    return answer.json()["results"]


def test_serve_refuses_a_damaged_index_in_one_line_naming_the_file_and_the_rebuild(built_index, tmp_path, capsys):
    folder = _copy(built_index, tmp_path / "index")
    shard = folder / EmbeddingIndex(str(folder)).manifest.shards[0]["embeddings"]
    shard.write_bytes(shard.read_bytes()[:-4])
    capsys.readouterr()
    assert main(["serve", "--index", str(folder), "--port", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"vlfit serve: error: {shard}: ") and "(truncated); rebuild it: vlfit retrieve index" in line
    with pytest.raises(DamagedIndexError, match=str(shard)):
        SearchEngine(str(folder))


def test_full_verify_refuses_embeddings_that_are_not_finite(built_index, tmp_path, capsys) -> None:
    from safetensors.torch import save_file

    folder = _copy(built_index, tmp_path / "index")
    index = EmbeddingIndex(str(folder))
    embeddings = index.embeddings()
    embeddings[1] = float("nan")
    shard = index.manifest.shards[0]
    save_file({"embeddings": embeddings[: shard["count"]].contiguous()}, str(folder / shard["embeddings"]))
    for entry in index.manifest.shards:  # an index written before sizes and checksums were recorded
        entry.pop("files")
    write_manifest(str(folder), index.manifest)

    with pytest.raises(DamagedIndexError, match=r"1 of \d+ embeddings hold NaN or infinite values; rebuild it"):
        SearchEngine(str(folder), verify="full")
    capsys.readouterr()
    assert main(["serve", "--index", str(folder), "--port", "0", "--verify", "full"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"vlfit serve: error: {folder / shard['embeddings']}: 1 of ")
    assert "embeddings hold NaN or infinite values; rebuild it: vlfit retrieve index" in errors[0]

    # The quick check (the default) serves it: the NaN row is left out, and every query is answered.
    engine = SearchEngine(str(folder))
    with TestClient(create_app(engine, reload_interval=0)) as client:
        results = _answered(client)
        assert len(results) == QUERY["k"] and all(result["row"] != 1 for result in results)
        assert all(isinstance(result["score"], float) for result in results)
        big = client.post("/api/search", json={**QUERY, "k": 1000}).json()["results"]
        assert len(big) == len(engine.snapshot) - 1


def test_a_reload_onto_a_damaged_index_keeps_serving_the_previous_snapshot(built_index, tmp_path, caplog) -> None:
    folder = _copy(built_index, tmp_path / "index")
    engine = SearchEngine(str(folder))
    with TestClient(create_app(engine, reload_interval=0)) as client:
        before = _answered(client)
        ids = folder / engine.snapshot.manifest.shards[0]["ids"]
        ids.write_text(ids.read_text()[:-10])
        manifest = folder / MANIFEST_NAME
        manifest.write_text(manifest.read_text() + " ")  # a new manifest, naming a damaged file
        answer = client.post("/api/reload").json()
        assert answer["reloaded"] is False and answer["generation"] == 1
        assert f"cannot be served ({ids}: " in caplog.text and "rebuild it: vlfit retrieve index" in caplog.text
        assert _answered(client) == before


def test_a_snapshot_skips_the_check_made_at_its_manifest_and_checks_a_manifest_changed_since(
    built_index, tmp_path, monkeypatch
) -> None:
    import vlfit.index.verify
    from vlfit.index.verify import verified_stamp
    from vlfit.serve.engine import Snapshot

    folder = str(_copy(built_index, tmp_path / "index"))
    checks, check = [], vlfit.index.verify.verify_index
    monkeypatch.setattr(vlfit.index.verify, "verify_index", lambda *a, **kw: checks.append(a) or check(*a, **kw))
    stamp = verified_stamp(folder, "full")  # the serve command's parent
    assert len(Snapshot(folder, "full", stamp)) > 0 and len(checks) == 1  # a worker: opened, not checked again
    manifest = Path(folder) / MANIFEST_NAME
    manifest.write_text(manifest.read_text() + " ")  # rebuilt meanwhile: a new manifest
    Snapshot(folder, "full", stamp)
    assert checks == [(folder, "full")] * 2


# Run in a process of its own: a SIGBUS there fails the test instead of killing pytest.
OVERWRITTEN_ANN = textwrap.dedent(
    """
    import os, sys
    import faiss, numpy as np, torch
    from vlfit.index.ann import AnnIndex
    from vlfit.index.ann_update import ids_digest
    from vlfit.index.integrity import DamagedIndexError
    from vlfit.index.manifest import write_manifest
    from vlfit.index.store import EmbeddingIndex, write_index_from_embeddings
    from vlfit.inference.identity import ModelIdentity
    from vlfit.serve.engine import Snapshot

    faiss.omp_set_num_threads(1)  # idle OpenMP threads spin on the cores the test shares
    folder, dim, rows = sys.argv[1], 8, 1000
    vectors = torch.nn.functional.normalize(torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)), dim=1)
    ids = [f"v{i}" for i in range(rows)]
    identity = ModelIdentity("clip", dim, "0" * 64)
    write_index_from_embeddings(folder, identity, {"path": "m", "backend": "torch", "precision": "fp32"}, ids,
                                vectors, collection={})
    # An IVF-PQ structure, the kind that was memory-mapped (small, to build in a moment).
    index = faiss.index_factory(dim, "IVF8,PQ4x4", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors.numpy())
    index.add(vectors.numpy())
    ann = AnnIndex(index, {"type": "ivfpq", "factory": "IVF8,PQ4x4", "params": {"nlist": 8, "m": 4, "nbits": 4},
                           "trained_on": rows, "search_params": {"nprobe": 8}, "rerank": 1,
                           "ids_digest": ids_digest(ids)})
    manifest = EmbeddingIndex(folder).manifest
    manifest.ann = ann.save(folder)
    write_manifest(folder, manifest)

    snapshot = Snapshot(folder)
    assert snapshot.search_kind == "ivfpq"
    queries = vectors[:20]
    before = snapshot.search(queries, 10)
    path = os.path.join(folder, "ann.faiss")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # overwritten in place, then cut short: the same inode the server opened
        f.write(b"\\0" * size)
        f.truncate(size // 3)
    assert snapshot.search(queries, 10) == before, "the served snapshot changed"
    try:
        Snapshot(folder)  # a reload reads the file again, and refuses it
    except DamagedIndexError as err:
        print("refused:", err)
    print("searched after the overwrite")
    """
)


@pytest.mark.slow
def test_an_ann_file_overwritten_in_place_while_served_cannot_kill_the_process(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", OVERWRITTEN_ANN, str(tmp_path / "index")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "searched after the overwrite" in done.stdout
    assert f"refused: {tmp_path / 'index' / 'ann.faiss'}: " in done.stdout and "(truncated)" in done.stdout
