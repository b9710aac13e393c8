"""Chroma (``chroma:PATH`` for a ``PersistentClient`` folder, ``chroma:http(s)://HOST:PORT`` for a server; each
``[#collection]``).

Items are stored under their own ids with their embeddings and the metadata ``row``, ``captions`` (JSON: Chroma's
metadata values are scalars), ``path`` (empty when none) and ``model``; the collection's metadata holds the
``CollectionRecord`` (JSON) under ``vlfit``, and its HNSW space is cosine (Chroma answers a distance, 1 - cosine).
Chroma always searches its HNSW graph: the collection is made with a search breadth (``ef_search``) that keeps small
collections' answers exact in practice; ``exact`` asks for no more than that.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import chromadb
import numpy as np
from chromadb.errors import ChromaError, NotFoundError

from vlfit.index.push.base import CollectionRecord, Found, HeldCollectionTarget, Items

METADATA_KEY = "vlfit"
EF_SEARCH = 256
PAGE = 5000


class ChromaTarget(HeldCollectionTarget):
    """A Chroma collection (see the module)."""

    ERRORS = (ChromaError, ValueError, RuntimeError, OSError)
    BATCH_SIZE = 5000  # below the largest batch a local Chroma takes (5461)

    @property
    def client(self) -> Any:
        return self.connected(self._connect)

    def _connect(self) -> Any:
        if not self.uri.remote:
            return chromadb.PersistentClient(path=self.uri.location)
        url = urlsplit(self.uri.location)
        return chromadb.HttpClient(host=url.hostname or "localhost", port=url.port or 8000, ssl=url.scheme == "https")

    def record(self) -> CollectionRecord | None:
        try:
            collection = self.client.get_collection(self.uri.collection, embedding_function=None)
        except NotFoundError:
            return None
        record = CollectionRecord.parse((collection.metadata or {}).get(METADATA_KEY))
        if record is None:
            raise self.refuse_shape("has no vlfit record in its metadata")
        space = ((collection.configuration or {}).get("hnsw") or {}).get("space")
        if space not in (None, "cosine"):
            raise self.refuse_shape(f"ranks by {space}")
        self._collection = collection
        return record

    def create(self, record: CollectionRecord) -> None:
        self._collection = self.client.create_collection(
            self.uri.collection,
            metadata={METADATA_KEY: record.to_json()},
            configuration={"hnsw": {"space": "cosine", "ef_search": EF_SEARCH}},
            embedding_function=None,
        )

    def ids(self) -> set[str]:
        found: set[str] = set()
        while True:
            page = self.collection.get(include=[], limit=PAGE, offset=len(found))["ids"]
            found.update(page)
            if len(page) < PAGE:
                return found

    def write(self, items: Items, *, new: bool) -> None:
        metadatas = [
            {"row": payload["row"], "captions": json.dumps(payload["captions"]), "path": payload["path"] or "",
             "model": payload["model"]}
            for payload in items.payloads()
        ]  # fmt: skip
        (self.collection.add if new else self.collection.upsert)(
            ids=items.ids, embeddings=items.vectors, metadatas=metadatas
        )

    def delete(self, ids: list[str]) -> None:
        if ids:
            self.collection.delete(ids=ids)

    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        k = min(k, self.collection.count())
        if k == 0:
            return [[] for _ in queries]
        answer = self.collection.query(query_embeddings=queries, n_results=k, include=["metadatas", "distances"])
        return [
            [
                Found(item, 1.0 - float(distance), int(meta["row"]), json.loads(str(meta["captions"])))
                for item, distance, meta in zip(ids, distances, metas, strict=True)
            ]  # fmt: skip
            for ids, distances, metas in zip(answer["ids"], answer["distances"], answer["metadatas"], strict=True)
        ]

    def count(self) -> int:
        return self.collection.count()


TARGET = ChromaTarget
