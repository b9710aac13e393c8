"""Qdrant (``qdrant:PATH``, ``qdrant::memory:``, ``qdrant:http(s)://HOST:PORT``, each ``[#collection]``).

A path or ``:memory:`` is qdrant-client's local mode (embedded, exact search); a URL is a Qdrant server (its API key,
when it has one, from ``QDRANT_API_KEY``). Points are stored under a UUID derived from the item id (Qdrant takes no
string ids; ``point_id``), with the payload ``id``, ``row``, ``captions``, ``path`` and ``model``; the collection's
metadata holds the ``CollectionRecord`` under ``vlfit``, and it is created with cosine distance. Local mode allows one
client per folder: the clients of a process are shared by location (``shared_client``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from qdrant_client import QdrantClient, models
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from vlfit.index.push.base import CollectionRecord, Found, Items, Target, point_id, shared_client

METADATA_KEY = "vlfit"
SCROLL_PAGE = 10_000


class QdrantTarget(Target):
    """A Qdrant collection (see the module)."""

    # Local mode raises ValueError/RuntimeError for what it refuses; a server's answers and connection failures are
    # qdrant-client's own exceptions (grpc is not used).
    ERRORS = (ResponseHandlingException, UnexpectedResponse, ValueError, RuntimeError, OSError)
    COMPACT = {"int8": "Qdrant's int8 scalar quantization", "binary": "Qdrant's binary quantization"}

    @property
    def client(self) -> QdrantClient:
        location = self.uri.location
        with self.failing("opening the database"):
            if location == ":memory:":
                return shared_client(self.uri, lambda: QdrantClient(location=":memory:"))
            if self.uri.remote:
                key = os.environ.get("QDRANT_API_KEY")
                return shared_client(self.uri, lambda: QdrantClient(url=location, api_key=key))
            return shared_client(self.uri, lambda: QdrantClient(path=location))

    def record(self) -> CollectionRecord | None:
        name = self.uri.collection
        if not self.client.collection_exists(name):
            return None
        config = self.client.get_collection(name).config
        record = CollectionRecord.parse_dict((config.metadata or {}).get(METADATA_KEY))
        vectors = config.params.vectors
        if record is None or not isinstance(vectors, models.VectorParams):
            raise self.refuse_shape("has no vlfit record in its metadata")
        if vectors.size != record.identity.embedding_size or vectors.distance != models.Distance.COSINE:
            raise self.refuse_shape(f"holds vectors of size {vectors.size} by {vectors.distance}")
        return record

    def create(self, record: CollectionRecord) -> None:
        vectors = models.VectorParams(size=record.identity.embedding_size, distance=models.Distance.COSINE)
        self.client.create_collection(self.uri.collection, vectors_config=vectors, metadata={METADATA_KEY:
                                      record.to_dict()}, quantization_config=quantization(self.storage))  # fmt: skip

    def ids(self) -> set[str]:
        found: set[str] = set()
        offset: Any = None
        while True:
            points, offset = self.client.scroll(self.uri.collection, limit=SCROLL_PAGE, offset=offset,
                                                with_payload=["id"], with_vectors=False)  # fmt: skip
            found.update(str((point.payload or {})["id"]) for point in points)
            if offset is None:
                return found

    def write(self, items: Items, *, new: bool) -> None:
        batch = models.Batch(ids=[point_id(item) for item in items.ids], vectors=items.vectors.tolist(),
                             payloads=list(items.payloads()))  # fmt: skip
        self.client.upsert(self.uri.collection, points=batch, wait=True)

    def delete(self, ids: list[str]) -> None:
        selector = models.PointIdsList(points=[point_id(item) for item in ids])
        self.client.delete(self.uri.collection, points_selector=selector, wait=True)

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        params = models.SearchParams(exact=exact) if self.uri.remote else None  # local mode is always exact
        requests = [models.QueryRequest(query=query.tolist(), limit=k, params=params, with_payload=True)
                    for query in queries]  # fmt: skip
        answers = self.client.query_batch_points(self.uri.collection, requests=requests)
        return [
            [
                Found(str(p.payload["id"]), float(p.score), int(p.payload["row"]), p.payload.get("captions"))
                for p in answer.points
                if p.payload is not None
            ]  # fmt: skip
            for answer in answers
        ]

    def count(self) -> int:
        return self.client.count(self.uri.collection, exact=True).count


def quantization(storage: str) -> models.QuantizationConfig | None:
    """The collection's quantization for an index of ``--vector_storage storage`` (kept in RAM; Qdrant searches the
    codes and re-scores with the float32 vectors it keeps too); local mode keeps none (its search is exact)."""
    if storage == "int8":
        return models.ScalarQuantization(scalar=models.ScalarQuantizationConfig(type=models.ScalarType.INT8,
                                                                                always_ram=True))  # fmt: skip
    if storage == "binary":
        return models.BinaryQuantization(binary=models.BinaryQuantizationConfig(always_ram=True))
    return None


TARGET = QdrantTarget
