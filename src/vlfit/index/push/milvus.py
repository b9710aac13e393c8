"""Milvus (``milvus:PATH.db`` for Milvus Lite, embedded in one file; ``milvus:http(s)://HOST:PORT`` for a server,
its token from ``MILVUS_TOKEN``; each ``[#collection]``), through pymilvus's ``MilvusClient``.

The collection's schema: ``id`` (VARCHAR, the primary key), ``vector`` (FLOAT_VECTOR of the embedding size), ``row``
(INT64), ``payload`` (JSON: ``captions``, ``path``, ``model``); a FLAT (exact) index by COSINE, whose scores are the
cosine similarity; the ``CollectionRecord`` is the collection's ``vlfit`` property. New items are inserted (Milvus's
bulk write), items that may be there already upserted. Milvus Lite allows one client per file: the clients of a
process are shared by location (``shared_client``).
"""

from __future__ import annotations

import os

import numpy as np
from pymilvus import DataType, MilvusClient, MilvusException

from vlfit.index.push.base import CollectionRecord, Found, Items, Target, shared_client

METADATA_KEY = "vlfit"
FIELDS = ("id", "vector", "row", "payload")
MAX_ID_LENGTH = 4096
PAGE = 10_000


class MilvusTarget(Target):
    """A Milvus collection (see the module)."""

    ERRORS = (MilvusException, ValueError, RuntimeError, OSError)
    BATCH_SIZE = 5000  # under the 64 MB a Milvus request may carry, up to 2048 dimensions

    @property
    def client(self) -> MilvusClient:
        location = self.uri.location
        token = os.environ.get("MILVUS_TOKEN", "") if self.uri.remote else ""
        with self.failing("opening the database"):
            if self.uri.remote:
                return shared_client(self.uri, lambda: MilvusClient(uri=location, token=token))
            # Milvus Lite makes its file, not the folder (the other engines make theirs), and serves it from a
            # thread of this process until released.
            os.makedirs(os.path.dirname(os.path.abspath(location)), exist_ok=True)
            from milvus_lite.server_manager import server_manager_instance

            return shared_client(self.uri, lambda: MilvusClient(uri=location),
                                 lambda: server_manager_instance.release_server(location))  # fmt: skip

    def record(self) -> CollectionRecord | None:
        name = self.uri.collection
        if not self.client.has_collection(name):
            return None
        described = self.client.describe_collection(name)
        record = CollectionRecord.parse((described.get("properties") or {}).get(METADATA_KEY))
        fields = tuple(field["name"] for field in described.get("fields", []))
        if record is None or fields != FIELDS:
            raise self.refuse_shape(f"has the fields {', '.join(fields)} and no vlfit property")
        self.client.load_collection(name)  # a collection opened again is released until loaded
        return record

    def create(self, record: CollectionRecord) -> None:
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_LENGTH)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=record.identity.embedding_size)
        schema.add_field("row", DataType.INT64)
        schema.add_field("payload", DataType.JSON)
        index = self.client.prepare_index_params()
        index.add_index("vector", index_type="FLAT", metric_type="COSINE")
        self.client.create_collection(self.uri.collection, schema=schema, index_params=index,
                                      properties={METADATA_KEY: record.to_json()})  # fmt: skip

    def ids(self) -> set[str]:
        found: set[str] = set()
        iterator = self.client.query_iterator(self.uri.collection, batch_size=PAGE, output_fields=["id"])
        try:
            while page := iterator.next():
                found.update(str(entity["id"]) for entity in page)
        finally:
            iterator.close()
        return found

    def write(self, items: Items, *, new: bool) -> None:
        data = [
            {"id": payload["id"], "vector": vector, "row": payload["row"],
             "payload": {"captions": payload["captions"], "path": payload["path"], "model": payload["model"]}}
            for payload, vector in zip(items.payloads(), items.vectors.tolist(), strict=True)
        ]  # fmt: skip
        (self.client.insert if new else self.client.upsert)(self.uri.collection, data)

    def delete(self, ids: list[str]) -> None:
        if ids:
            self.client.delete(self.uri.collection, ids=ids)

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        answers = self.client.search(
            self.uri.collection, data=queries.tolist(), limit=k, output_fields=["row", "payload"],
            search_params={"metric_type": "COSINE"},
        )  # fmt: skip
        return [
            [
                Found(
                    str(hit["id"]),
                    float(hit["distance"]),
                    int(hit["entity"]["row"]),
                    hit["entity"]["payload"].get("captions"),
                )
                for hit in hits
            ]  # fmt: skip
            for hits in answers
        ]

    def count(self) -> int:
        found = self.client.query(self.uri.collection, filter="", output_fields=["count(*)"])
        return int(found[0]["count(*)"])


TARGET = MilvusTarget
