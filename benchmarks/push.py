"""``vlfit retrieve push`` to each vector database beside the engine's own bulk load, and queries through each beside
the local FAISS index, on this machine.

Synthetic embeddings (no model: the push and the search only): N unit vectors of size D (``--items``, 10^5, and
``--dim``, 512), drawn around 1000 random centres, written as an index's shards (``write_index_from_embeddings``).
For each engine, embedded in a fresh folder of ``--out`` (PostgreSQL: the pgserver wheel's embedded server):

- push: ``push_index`` into a new collection (batches of ``--batch_size``), items/s;
- bulk: the engine's own bulk-load path on the same vectors and payloads into another collection: LanceDB's
  ``create_table`` from one Arrow table; Qdrant's ``upload_points``; Chroma's ``add`` in its largest batches;
  PostgreSQL's ``COPY`` into the table, then ``CREATE INDEX ... USING hnsw``; Milvus's ``insert`` in batches of
  10,000. Goal: push >= 0.8x bulk;
- query: p50 of one query (k = 10) through ``PushedIndex.search`` (the path of ``vlfit retrieve query --index URI``;
  approximate where the engine is: pgvector's HNSW, Chroma's HNSW), over ``--queries`` queries, beside the p50 of the
  same queries against a local FAISS flat index of the same vectors (what a vlfit index below 10^5 items gets).
  Goal: within 2x.

Qdrant runs in its local mode in memory (``qdrant::memory:``): its folder mode commits every point on its own (about
50 points/s here), which measures SQLite, not the push.

    python benchmarks/push.py [--items 100000] [--dim 512] [--engines lancedb,qdrant,chroma,pgvector,milvus]
        [--out runs/push-bench] [--results benchmarks/results/cpu-2core]

Writes ``push.json`` to ``--results`` (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vlfit.index.push.base import CollectionRecord, Items, close_shared_clients, open_target
from vlfit.index.push.job import index_record, push_index
from vlfit.index.push.pushed import PushedIndex
from vlfit.index.store import EmbeddingIndex, write_index_from_embeddings
from vlfit.inference.identity import ModelIdentity

ENGINES = ("lancedb", "qdrant", "chroma", "pgvector", "milvus")


def synthetic_vectors(count: int, dim: int, seed: int = 0) -> np.ndarray:
    """Unit vectors around 1000 random centres (real embeddings cluster)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    vectors = centres[rng.integers(0, 1000, count)] + 0.5 * rng.standard_normal((count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def all_items(index: EmbeddingIndex, record: CollectionRecord) -> Items:
    ids = list(index.row_ids)
    vectors = index.embeddings().numpy()
    return Items(ids, vectors, list(range(len(ids))), [None] * len(ids), [None] * len(ids),
                 record.identity.checkpoint_sha256)  # fmt: skip


def bulk_load(uri: str, items: Items, record: CollectionRecord) -> None:
    """The engine's own bulk path for ``items`` into the collection of ``uri`` (as the module says)."""
    target = open_target(uri)
    engine = target.uri.scheme
    if engine == "lancedb":
        target.db.create_table(target.uri.collection, data=target_arrow(target, items, record))
    elif engine == "qdrant":
        from qdrant_client import models

        target.create(record)
        values = zip(_point_ids(items), items.vectors.tolist(), items.payloads(), strict=True)
        points = (models.PointStruct(id=point, vector=vector, payload=payload) for point, vector, payload in values)
        target.client.upload_points(target.uri.collection, points, batch_size=1024)
    elif engine == "chroma":
        target.create(record)
        largest = target.client.get_max_batch_size()
        metadatas = [{"row": row, "model": items.model} for row in items.rows]
        for start in range(0, len(items), largest):
            part = slice(start, start + largest)
            target.collection.add(ids=items.ids[part], embeddings=items.vectors[part], metadatas=metadatas[part])
    elif engine == "postgresql":
        from psycopg import sql

        connection = target.connection
        size = sql.Literal(items.vectors.shape[1])
        create = "CREATE TABLE {} (id text PRIMARY KEY, embedding vector({}), row bigint, captions jsonb, path text, "
        connection.execute(sql.SQL(create + "model text)").format(target.table, size))
        with connection.transaction(), connection.cursor() as cursor:
            copy = sql.SQL("COPY {} (id, embedding, row, model) FROM STDIN WITH (FORMAT BINARY)").format(target.table)
            with cursor.copy(copy) as writer:
                writer.set_types(["text", "vector", "int8", "text"])
                for item, vector, row in zip(items.ids, items.vectors, items.rows, strict=True):
                    writer.write_row((item, vector, row, items.model))
        connection.execute(sql.SQL("CREATE INDEX ON {} USING hnsw (embedding vector_cosine_ops)").format(target.table))
    else:
        target.create(record)
        data = [{"id": item, "vector": vector, "row": row, "payload": {"model": items.model}}
                for item, vector, row in zip(items.ids, items.vectors.tolist(), items.rows, strict=True)]  # fmt: skip
        for start in range(0, len(data), 10_000):
            target.client.insert(target.uri.collection, data[start : start + 10_000])


def _point_ids(items: Items) -> list[str]:
    from vlfit.index.push.base import point_id

    return [point_id(item) for item in items.ids]


def target_arrow(target, items: Items, record: CollectionRecord):
    """``items`` as one Arrow table of the LanceDB target's schema."""
    import pyarrow as pa

    schema = target._schema(record)

    size = items.vectors.shape[1]
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(items.vectors.reshape(-1), pa.float32()), size)
    columns = [pa.array(items.ids, pa.string()), vectors, pa.array(items.rows, pa.int64()),
               pa.array(items.captions, pa.list_(pa.string())), pa.array(items.paths, pa.string()),
               pa.array([items.model] * len(items), pa.string())]  # fmt: skip
    return pa.Table.from_arrays(columns, schema=schema)


def p50_ms(run: Callable[[np.ndarray], object], queries: np.ndarray) -> float:
    run(queries[:1])  # warm
    times = []
    for query in queries:
        started = time.perf_counter()
        run(query[None])
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=None, help="default: each engine's (Target.BATCH_SIZE)")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--out", default="runs/push-bench")
    parser.add_argument("--results", default=None)
    args = parser.parse_args()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    vectors = synthetic_vectors(args.items, args.dim)
    identity = ModelIdentity("synthetic", args.dim, "preset:synthetic")
    ids = [f"item-{number:07d}" for number in range(args.items)]
    write_index_from_embeddings(str(out / "index"), identity, {"path": "none", "backend": "torch"}, ids,
                                torch.from_numpy(vectors), collection={"dataset_name": "synthetic"})  # fmt: skip
    index = EmbeddingIndex(str(out / "index"))
    record = index_record(index)
    items = all_items(index, record)
    queries = synthetic_vectors(args.queries, args.dim, seed=1)

    import faiss

    flat = faiss.IndexFlatIP(args.dim)
    flat.add(vectors)
    local_p50 = p50_ms(lambda q: flat.search(q, 10), queries)

    postgres = None
    rows = []
    for engine in args.engines.split(","):
        if engine == "pgvector":
            import pgserver

            postgres = pgserver.get_server(tempfile.mkdtemp(prefix="vlfit-push-bench-"), cleanup_mode="delete")
            base = {name: f"{postgres.get_uri()}#{name}" for name in ("pushed", "bulk")}
        elif engine == "qdrant":
            base = {name: f"qdrant::memory:#{name}" for name in ("pushed", "bulk")}
        else:
            suffix = ".db" if engine == "milvus" else ""
            base = {name: f"{engine}:{out / engine}{suffix}#{name}" for name in ("pushed", "bulk")}
        open_target(base["pushed"])  # the client library imported before the clocks start, for both
        report = push_index(index, base["pushed"], batch_size=args.batch_size)
        started = time.perf_counter()
        bulk_load(base["bulk"], items, record)
        bulk_seconds = time.perf_counter() - started
        pushed = PushedIndex(base["pushed"])
        query_p50 = p50_ms(lambda q, p=pushed: p.search(torch.from_numpy(q), 10), queries)
        row = {
            "engine": engine, "items": args.items, "dim": args.dim,
            "push_items_per_s": round(report.items_per_second, 1),
            "bulk_items_per_s": round(args.items / bulk_seconds, 1),
            "push_vs_bulk": round(report.items_per_second * bulk_seconds / args.items, 2),
            "query_p50_ms": round(query_p50, 3), "faiss_flat_p50_ms": round(local_p50, 3),
            "query_vs_faiss": round(query_p50 / local_p50, 1),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        close_shared_clients()
    if postgres is not None:
        postgres.cleanup()

    print(f"\n{'engine':<9} {'push/s':>9} {'bulk/s':>9} {'ratio':>6} {'query p50 ms':>13} {'faiss p50 ms':>13}")
    for row in rows:
        print(f"{row['engine']:<9} {row['push_items_per_s']:>9.0f} {row['bulk_items_per_s']:>9.0f} "
              f"{row['push_vs_bulk']:>6.2f} {row['query_p50_ms']:>13.2f} "
              f"{row['faiss_flat_p50_ms']:>13.3f}")  # fmt: skip
    if args.results:
        results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "rows": rows}
        Path(args.results).mkdir(parents=True, exist_ok=True)
        (Path(args.results) / "push.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
