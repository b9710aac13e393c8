"""PostgreSQL with pgvector (``postgresql://USER[:PASSWORD]@HOST[:PORT]/DB[#table]``, ``postgres://`` too; libpq's
environment variables, ``PGPASSWORD`` and the rest, apply), through psycopg 3.

The push that creates the table runs ``CREATE EXTENSION IF NOT EXISTS vector`` and makes a table with the columns
``id`` (text, the primary key), ``embedding`` (``vector(D)``), ``row``, ``captions`` (jsonb: a list, or null),
``path`` and ``model``, and the ``CollectionRecord`` as the table's comment; once the items are written, an HNSW index
over the embeddings by cosine distance (``vector_cosine_ops``). New items are written with ``COPY`` (PostgreSQL's
bulk load); items that may be there already with ``INSERT ... ON CONFLICT (id) DO UPDATE`` in one pipelined batch.
A search only reads (a role that may only read, a replica): in a database without the extension there is no table
of a push to search. It orders by ``embedding <=> query`` (cosine distance; the score is 1 - distance) through the
HNSW index, with ``hnsw.ef_search`` at least the k asked for; an HNSW scan returns no more rows than that, whose
largest value is 1,000, so a search for more hits, like ``exact``, scans the table (index scans off for its
transaction), comparing every row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector
from psycopg import sql
from psycopg.types.json import Jsonb

from vlfit.index.push.base import CollectionRecord, Found, Items, Target

COLUMNS = ("id", "embedding", "row", "captions", "path", "model")
# pgvector's largest hnsw.ef_search, and so the most rows an HNSW index scan returns.
EF_SEARCH_MAX = 1000


class PgvectorTarget(Target):
    """A PostgreSQL table with a pgvector column (see the module)."""

    ERRORS = (psycopg.Error,)
    BATCH_SIZE = 10_000  # one COPY per transaction

    def __init__(self, uri: Any) -> None:
        super().__init__(uri)
        self.table = sql.Identifier(uri.collection)

    @property
    def connection(self) -> psycopg.Connection:
        return self.connected(self._connect, "connecting")

    def _connect(self) -> psycopg.Connection:
        connection = psycopg.connect(self.uri.location, autocommit=True, connect_timeout=10)
        if connection.execute("SELECT 1 FROM pg_extension WHERE extname = 'vector'").fetchone():
            register_vector(connection)  # else no table of a push is there: only ``create`` makes the extension
        return connection

    def record(self) -> CollectionRecord | None:
        name = self.uri.collection
        found = self.connection.execute(
            "SELECT obj_description(to_regclass(%s), 'pg_class'), to_regclass(%s) IS NOT NULL",
            (sql.Identifier(name).as_string(self.connection), sql.Identifier(name).as_string(self.connection)),
        ).fetchone()
        assert found is not None
        comment, exists = found
        if not exists:
            return None
        columns = self.connection.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
            "AND table_schema = current_schema() ORDER BY ordinal_position",
            (name,),
        ).fetchall()
        record = CollectionRecord.parse(comment)
        if record is None or tuple(column for (column,) in columns) != COLUMNS:
            shown = ", ".join(column for (column,) in columns)
            raise self.refuse_shape(f"has the columns {shown} and no vlfit record as its comment")
        return record

    def create(self, record: CollectionRecord) -> None:
        size = record.identity.embedding_size
        self.connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
        register_vector(self.connection)
        with self.connection.transaction():
            self.connection.execute(
                sql.SQL(
                    "CREATE TABLE {} (id text PRIMARY KEY, embedding vector({}) NOT NULL, row bigint, "
                    "captions jsonb, path text, model text)"
                ).format(self.table, sql.Literal(size))
            )
            comment = sql.SQL("COMMENT ON TABLE {} IS {}").format(self.table, sql.Literal(record.to_json()))
            self.connection.execute(comment)

    def finish(self) -> None:
        # Built once over the pushed rows (what pgvector advises for a bulk load), not kept up row by row during the
        # first push: ten times faster here. Later pushes into the table update it as they write.
        index = sql.Identifier(f"{self.uri.collection}_embedding_hnsw")
        self.connection.execute(
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (embedding vector_cosine_ops)").format(
                index, self.table
            )
        )

    def ids(self) -> set[str]:
        return {item for (item,) in self.connection.execute(sql.SQL("SELECT id FROM {}").format(self.table))}

    def _rows(self, items: Items) -> list[tuple]:
        return [
            (payload["id"], vector, payload["row"], None if payload["captions"] is None else Jsonb(payload["captions"]),
             payload["path"], payload["model"])
            for payload, vector in zip(items.payloads(), items.vectors, strict=True)
        ]  # fmt: skip

    def write(self, items: Items, *, new: bool) -> None:
        rows = self._rows(items)
        with self.connection.transaction(), self.connection.cursor() as cursor:
            if new:
                copy = sql.SQL("COPY {} (id, embedding, row, captions, path, model) FROM STDIN WITH (FORMAT BINARY)")
                with cursor.copy(copy.format(self.table)) as writer:
                    writer.set_types(["text", "vector", "int8", "jsonb", "text", "text"])
                    for row in rows:
                        writer.write_row(row)
            else:
                cursor.executemany(
                    sql.SQL(
                        "INSERT INTO {} (id, embedding, row, captions, path, model) VALUES (%s, %s, %s, %s, %s, %s) "
                        "ON CONFLICT (id) DO UPDATE SET embedding = EXCLUDED.embedding, row = EXCLUDED.row, "
                        "captions = EXCLUDED.captions, path = EXCLUDED.path, model = EXCLUDED.model"
                    ).format(self.table),
                    rows,
                )

    def delete(self, ids: list[str]) -> None:
        self.connection.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(self.table), (ids,))

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        query = sql.SQL(
            "SELECT id, 1 - (embedding <=> %s) AS score, row, captions FROM {} ORDER BY embedding <=> %s LIMIT %s"
        ).format(self.table)
        results = []
        with self.connection.transaction(), self.connection.cursor() as cursor:
            if exact or k > EF_SEARCH_MAX:  # every row compared: a scan of the table, whatever the planner prefers
                cursor.execute("SET LOCAL enable_indexscan = off")
                cursor.execute("SET LOCAL enable_seqscan = on")
            else:
                cursor.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(max(40, k))))
            for vector in queries:
                rows = cursor.execute(query, (vector, vector, k)).fetchall()
                results.append([Found(item, float(score), int(row), captions) for item, score, row, captions in rows])
        return results

    def count(self) -> int:
        found = self.connection.execute(sql.SQL("SELECT count(*) FROM {}").format(self.table)).fetchone()
        return int(found[0]) if found else 0


TARGET = PgvectorTarget
