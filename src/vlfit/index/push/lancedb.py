"""LanceDB (``lancedb:PATH[#table]``): a folder of Lance tables the client embeds.

The table has the columns ``id`` (the item id), ``vector`` (fixed-size float32), ``row``, ``captions`` (a list of
strings, null when the index stores none), ``path`` and ``model``; its Arrow schema's metadata holds the
``CollectionRecord`` under ``vlfit``. New items are appended (``Table.add``, LanceDB's bulk load); items that may be
there already are merged on ``id`` (``merge_insert``), so a push never leaves two rows of one id. Without a vector
index a LanceDB search is an exact scan; searches ask for cosine distance (1 - cosine). Whether the table is there is
what the database lists (``list_tables``): a table it lists and cannot open is refused, not taken for none.
"""

from __future__ import annotations

from typing import Any

import lancedb
import numpy as np
import pyarrow as pa

from vlfit.index.push.base import CollectionRecord, Found, HeldCollectionTarget, Items

METADATA_KEY = b"vlfit"
COLUMNS = ("id", "vector", "row", "captions", "path", "model")


def _quoted(item: str) -> str:
    return "'" + item.replace("'", "''") + "'"


class LanceDBTarget(HeldCollectionTarget):
    """A LanceDB table (see the module)."""

    # lancedb raises the built-in kinds (ValueError, OSError, RuntimeError) for what the Lance engine refuses.
    ERRORS = (ValueError, OSError, RuntimeError, pa.ArrowException)
    BATCH_SIZE = 20_000  # each write is a commit and a fragment of its own

    @property
    def db(self) -> Any:
        return self.connected(lambda: lancedb.connect(self.uri.location))

    def _listed(self) -> bool:
        """Whether the database lists the table (one that it lists and cannot open is not taken for none)."""
        token = None
        while True:
            page = self.db.list_tables(page_token=token)
            if self.uri.collection in page.tables:
                return True
            token = page.page_token
            if not token:
                return False

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
        if not self._listed():
            return None
        table = self.db.open_table(self.uri.collection)
        schema = table.schema
        record = CollectionRecord.parse((schema.metadata or {}).get(METADATA_KEY))
        if record is None or tuple(schema.names) != COLUMNS:
            raise self.refuse_shape(f"has the columns {', '.join(schema.names)} and no vlfit record")
        self._collection = table
        return record

    def create(self, record: CollectionRecord) -> None:
        self._collection = self.db.create_table(self.uri.collection, schema=self._schema(record))

    def ids(self) -> set[str]:
        column = self.collection.search().select(["id"]).limit(None).to_arrow().column("id")
        return set(column.to_pylist())

    def _arrow(self, items: Items) -> pa.Table:
        size = items.vectors.shape[1]
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(items.vectors.reshape(-1), pa.float32()), size)
        columns = [pa.array(items.ids, pa.string()), vectors, pa.array(items.rows, pa.int64()),
                   pa.array(items.captions, pa.list_(pa.string())), pa.array(items.paths, pa.string()),
                   pa.array([items.model] * len(items), pa.string())]  # fmt: skip
        return pa.Table.from_arrays(columns, schema=self.collection.schema)

    def write(self, items: Items, *, new: bool) -> None:
        data = self._arrow(items)
        if new:
            self.collection.add(data)
        else:
            self.collection.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(data)

    def delete(self, ids: list[str]) -> None:
        if ids:
            self.collection.delete(f"id IN ({', '.join(_quoted(item) for item in ids)})")

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        results = []
        for query in queries:
            search = self.collection.search(query).distance_type("cosine").limit(k)
            if exact:
                search = search.bypass_vector_index()
            found = search.select(["id", "row", "captions", "_distance"]).to_arrow().to_pylist()
            results.append([Found(hit["id"], 1.0 - hit["_distance"], hit["row"], hit["captions"]) for hit in found])
        return results

    def count(self) -> int:
        return self.collection.count_rows()


TARGET = LanceDBTarget
