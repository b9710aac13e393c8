"""LanceDB (``lancedb:PATH[#table]``): a folder of Lance tables the client embeds.

The table has the columns ``id`` (the item id), ``vector`` (fixed-size float32), ``row``, ``captions`` (a list of
strings, null when the index stores none), ``path`` and ``model``; its Arrow schema's metadata holds the
``CollectionRecord`` under ``vlfit``. New items are appended (``Table.add``, LanceDB's bulk load); items that may be
there already are merged on ``id`` (``merge_insert``), so a push never leaves two rows of one id. Without a vector
index a LanceDB search is an exact scan; searches ask for cosine distance (1 - cosine).
"""

from __future__ import annotations

from typing import Any

import lancedb
import numpy as np
import pyarrow as pa

from vlfit.index.push.base import CollectionRecord, Found, Items, Target, TargetURI

METADATA_KEY = b"vlfit"
COLUMNS = ("id", "vector", "row", "captions", "path", "model")


def _quoted(item: str) -> str:
    return "'" + item.replace("'", "''") + "'"


class LanceDBTarget(Target):
    """A LanceDB table (see the module)."""

    # lancedb raises the built-in kinds (ValueError, OSError, RuntimeError) for what the Lance engine refuses.
    ERRORS = (ValueError, OSError, RuntimeError, pa.ArrowException)
    BATCH_SIZE = 20_000  # each write is a commit and a fragment of its own

    def __init__(self, uri: TargetURI) -> None:
        super().__init__(uri)
        self._db: Any = None
        self._table: Any = None

    @property
    def db(self) -> Any:
        if self._db is None:
            with self.failing("opening the database"):
                self._db = lancedb.connect(self.uri.location)
        return self._db

    def _schema(self, record: CollectionRecord) -> pa.Schema:
        size = record.identity.embedding_size
        fields = [
            pa.field("id", pa.string(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), size)),
            pa.field("row", pa.int64()),
            pa.field("captions", pa.list_(pa.string())),
            pa.field("path", pa.string()),
            pa.field("model", pa.string()),
        ]
        return pa.schema(fields, metadata={METADATA_KEY: record.to_json().encode()})

    def record(self) -> CollectionRecord | None:
        try:
            table = self.db.open_table(self.uri.collection)
        except ValueError as err:
            if "not found" in str(err):
                return None
            raise
        schema = table.schema
        record = CollectionRecord.parse((schema.metadata or {}).get(METADATA_KEY))
        if record is None or tuple(schema.names) != COLUMNS:
            raise self.refuse_shape(f"has the columns {', '.join(schema.names)} and no vlfit record")
        self._table = table
        return record

    def create(self, record: CollectionRecord) -> None:
        self._table = self.db.create_table(self.uri.collection, schema=self._schema(record))

    @property
    def table(self) -> Any:
        if self._table is None and self.record() is None:
            raise self.refuse_shape("is missing")  # every caller reads the record first
        return self._table

    def ids(self) -> set[str]:
        column = self.table.search().select(["id"]).limit(None).to_arrow().column("id")
        return set(column.to_pylist())

    def _arrow(self, items: Items) -> pa.Table:
        size = items.vectors.shape[1]
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(items.vectors.reshape(-1), pa.float32()), size)
        columns = [pa.array(items.ids, pa.string()), vectors, pa.array(items.rows, pa.int64()),
                   pa.array(items.captions, pa.list_(pa.string())), pa.array(items.paths, pa.string()),
                   pa.array([items.model] * len(items), pa.string())]  # fmt: skip
        return pa.Table.from_arrays(columns, schema=self.table.schema)

    def write(self, items: Items, *, new: bool) -> None:
        data = self._arrow(items)
        if new:
            self.table.add(data)
        else:
            self.table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(data)

    def delete(self, ids: list[str]) -> None:
        if ids:
            self.table.delete(f"id IN ({', '.join(_quoted(item) for item in ids)})")

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        results = []
        for query in queries:
            search = self.table.search(query).distance_type("cosine").limit(k)
            if exact:
                search = search.bypass_vector_index()
            found = search.select(["id", "row", "captions", "_distance"]).to_arrow().to_pylist()
            results.append([Found(hit["id"], 1.0 - hit["_distance"], hit["row"], hit["captions"]) for hit in found])
        return results

    def count(self) -> int:
        return self.table.count_rows()


TARGET = LanceDBTarget
