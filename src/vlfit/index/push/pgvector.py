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

An index built with ``--vector_storage int8`` or ``binary`` is pushed to pgvector's own compact forms (pgvector 0.7 or
later; an older server keeps the float32 index, and the push report says so in one line). The table keeps the
float32 column either way (for re-ranking and ``exact``); only the HNSW index is compact. ``int8``: the index is over
the half-precision expression ``(embedding::halfvec(D)) halfvec_cosine_ops`` (2 bytes a dimension: pgvector has no
8-bit form), and a search orders by the same expression, so the planner uses it, then orders its k rows by the full
cosine. ``binary``: the index is over ``(binary_quantize(embedding)::bit(D)) bit_hamming_ops`` (one bit a dimension),
and a search takes the top ``--rescore`` x k (at most 1,000) by Hamming distance through it and re-ranks them by the
full ``embedding <=> query`` (pgvector's binary quantization with re-ranking), the index's ``--rescore`` kept as the
HNSW index's comment. What a search does is read from the table's indexes (``pg_indexes``), so it follows the index
the table has, whichever push made it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector
from psycopg import sql
from psycopg.types.json import Jsonb

from vlfit.index.ann_choice import STORAGE_RESCORE
from vlfit.index.push.base import CollectionRecord, Found, Items, Target

COLUMNS = ("id", "embedding", "row", "captions", "path", "model")
# pgvector's largest hnsw.ef_search, and so the most rows an HNSW index scan returns.
EF_SEARCH_MAX = 1000
# The first pgvector with halfvec and binary_quantize.
COMPACT_VERSION = (0, 7)
# Per --vector_storage: the HNSW index's expression and operator class, and the distance a search orders by through
# it (the index's expression again, or the planner does not use the index). {size}: the embedding size.
FORMS = {
    "float32": ("embedding", "vector_cosine_ops", "embedding <=> %(query)s"),
    "int8": ("(embedding::halfvec({size}))", "halfvec_cosine_ops",
             "embedding::halfvec({size}) <=> %(query)s::halfvec({size})"),
    "binary": ("(binary_quantize(embedding)::bit({size}))", "bit_hamming_ops",
               "binary_quantize(embedding)::bit({size}) <~> binary_quantize(%(query)s)"),
}  # fmt: skip


class PgvectorTarget(Target):
    """A PostgreSQL table with a pgvector column (see the module)."""

    ERRORS = (psycopg.Error,)
    BATCH_SIZE = 10_000  # one COPY per transaction
    COMPACT = {
        "int8": "pgvector's HNSW index over halfvec (half precision, 2 bytes a dimension)",
        "binary": "pgvector's HNSW index over binary_quantize bits, its top --rescore x k re-ranked by cosine",
    }

    def __init__(self, uri: Any) -> None:
        super().__init__(uri)
        self.table = sql.Identifier(uri.collection)
        self.size = 0  # the embedding size, as ``record`` or ``create`` read it

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
        self.size = record.identity.embedding_size
        return record

    def pgvector_version(self) -> str:
        """The version of pgvector in the database, or the one ``CREATE EXTENSION`` would make ("" for none)."""
        found = self.connection.execute(
            "SELECT coalesce((SELECT extversion FROM pg_extension WHERE extname = 'vector'), "
            "(SELECT default_version FROM pg_available_extensions WHERE name = 'vector'))"
        ).fetchone()
        return str(found[0]) if found and found[0] else ""

    def compact_forms(self) -> bool:
        """Whether the database's pgvector has halfvec and binary_quantize (0.7 or later)."""
        return tuple(int(part) for part in re.findall(r"\d+", self.pgvector_version())[:2]) >= COMPACT_VERSION

    def storage_note(self) -> str:
        if self.storage != "float32" and not self.compact_forms():
            return (f"no {self.storage} form used: the server's pgvector {self.pgvector_version() or '(none)'} has no "
                    "halfvec or binary_quantize (0.7 or later has); the push sends float32 vectors and indexes them "
                    "as they are")  # fmt: skip
        return super().storage_note()

    def _indexes(self) -> list[tuple[str, str | None]]:
        """The table's indexes, as ``pg_indexes`` defines them, each with its comment."""
        return self.connection.execute(
            "SELECT indexdef, obj_description((quote_ident(schemaname) || '.' || quote_ident(indexname))::regclass, "
            "'pg_class') FROM pg_indexes WHERE schemaname = current_schema() AND tablename = %s",
            (self.uri.collection,),
        ).fetchall()

    def indexed(self) -> tuple[str, int]:
        """The form the table's HNSW index keeps, as a ``--vector_storage`` (``binary`` for bits, ``int8`` for
        halfvec, else ``float32``), and the re-ranking factor its comment records (binary's default if none)."""
        for storage in ("binary", "int8"):
            _, operators, _ = FORMS[storage]
            for definition, comment in self._indexes():
                if "USING hnsw" in definition and operators in definition:
                    return storage, _recorded_rescore(comment) or STORAGE_RESCORE.get(storage, 1)
        return "float32", 1

    def create(self, record: CollectionRecord) -> None:
        size = self.size = record.identity.embedding_size
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
        if any("USING hnsw" in definition for definition, _ in self._indexes()):
            return
        storage = self.storage if self.compact_forms() else "float32"
        expression, operators, _ = FORMS[storage]
        index = sql.Identifier(f"{self.uri.collection}_embedding_hnsw")
        with self.connection.transaction():
            self.connection.execute(
                sql.SQL("CREATE INDEX {} ON {} USING hnsw ({} {})").format(
                    index, self.table, sql.SQL(expression.format(size=int(self.size))), sql.SQL(operators)
                )
            )
            if storage != "float32":  # what a search of the table reads back (``indexed``)
                note = json.dumps({"vector_storage": storage, "rescore": self.rescore})
                self.connection.execute(sql.SQL("COMMENT ON INDEX {} IS {}").format(index, sql.Literal(note)))

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

    def statement(self, k: int, size: int, *, exact: bool = False) -> tuple[sql.Composed, int, bool]:
        """What ``search`` runs for ``k`` hits of queries of ``size`` (the parameters ``query``, ``candidates`` and
        ``k``): the statement, how many candidates the index finds, and whether it scans the table instead."""
        # Every row compared for ``exact`` and beyond what an HNSW scan returns: a scan of the float32 column.
        scan = exact or k > EF_SEARCH_MAX
        storage, rescore = ("float32", 1) if scan else self.indexed()
        candidates = min(k * rescore, EF_SEARCH_MAX) if storage == "binary" else k
        # The candidates the index finds, re-ranked by the full cosine (for float32 and halfvec: the same rows).
        statement = sql.SQL(
            "SELECT id, 1 - (embedding <=> %(query)s) AS score, row, captions FROM (SELECT id, embedding, row, "
            "captions FROM {} ORDER BY {} LIMIT %(candidates)s) AS found ORDER BY embedding <=> %(query)s LIMIT %(k)s"
        ).format(self.table, sql.SQL(FORMS[storage][2].format(size=int(size))))
        return statement, candidates, scan

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        statement, candidates, scan = self.statement(k, queries.shape[1], exact=exact)
        results = []
        with self.connection.transaction(), self.connection.cursor() as cursor:
            if scan:
                cursor.execute("SET LOCAL enable_indexscan = off")
                cursor.execute("SET LOCAL enable_seqscan = on")
            else:
                cursor.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(max(40, candidates))))
            for vector in queries:
                rows = cursor.execute(statement, {"query": vector, "candidates": candidates, "k": k}).fetchall()
                results.append([Found(item, float(score), int(row), captions) for item, score, row, captions in rows])
        return results

    def count(self) -> int:
        found = self.connection.execute(sql.SQL("SELECT count(*) FROM {}").format(self.table)).fetchone()
        return int(found[0]) if found else 0


def _recorded_rescore(comment: str | None) -> int | None:
    """The ``rescore`` a compact index's comment records (None: no comment of a push)."""
    try:
        value = json.loads(comment or "null")
        return int(value["rescore"]) if isinstance(value, dict) and "rescore" in value else None
    except (ValueError, TypeError):
        return None


TARGET = PgvectorTarget
