"""``vlfit.Index``: build, append to, open, push and search an embedding index from Python."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vlfit.api.model import Model, check_at_least, load, text_list
from vlfit.errors import ConfigError, DataError, python_api
from vlfit.index.search import Hit
from vlfit.inference.runtime_settings import RuntimeSettings

SearchHit = Hit  # one result of ``Index.search``: the one hit type of every search (``vlfit.index.search.Hit``)


class Index:
    """An embedding index on disk (what ``vlfit retrieve index`` builds): build, open, append, search.

    Build one with ``Index.build(model, "runs/index", images="photos/")`` (or ``dataset_name=..., split=...``),
    open it later with ``Index.open("runs/index")``, add the new images of the folder with ``append()``, and
    search it with ``search("a red square", k=5)``. An index opens only when its files are those its manifest
    records (``verify``: ``quick``, each file there with its size, or ``full``, checksums and finite embeddings
    too); otherwise ``vlfit.index.integrity.DamagedIndexError`` (a ``DataError``) names the file and the command
    that rebuilds it.

    ``push("qdrant:vectors")`` writes the index to a vector database (``vlfit retrieve push``), and
    ``Index.open("qdrant:vectors")`` searches what was pushed there with the model recorded in it, with the same hits.
    """

    def __init__(self, path: str, model: Model | None = None, verify: str = "quick") -> None:
        self.path = path
        self._model = model
        self._reload(verify)

    def _reload(self, verify: str = "quick") -> None:
        from vlfit.index.push.base import is_target_uri
        from vlfit.index.verify import open_index

        if is_target_uri(self.path):  # a collection vlfit retrieve push wrote
            from vlfit.index.push.pushed import PushedIndex

            self._index: Any = PushedIndex(self.path)
        else:
            self._index = open_index(self.path, verify)  # the manifest as the last build wrote it
        self._reranker: Any = None  # opened by the first search that re-ranks

    def __len__(self) -> int:
        return len(self._index)

    @property
    def model(self) -> Model:
        """The model the index was built with (loaded on first use)."""
        if self._model is None:
            from vlfit.index.search import query_runtime

            self._model = Model(query_runtime(self._index))
        return self._model

    @classmethod
    @python_api(renames={"index": "path", "output_dir": "path", "dataloader_num_workers": "num_workers"})
    def build(
        cls,
        model: Model | str,
        path: str,
        *,
        images: str | None = None,
        dataset_name: str | None = None,
        split: str = "test",
        image_column: str = "image",
        caption_column: str | None = "image_description",
        image_id_column: str | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        shard_size: int | None = None,
        progress: bool = False,
        index_type: str | None = None,
        max_index_memory: int | None = None,
        target_recall: float | None = None,
        verify: str = "quick",
        vector_storage: str | None = None,
        rescore: int | None = None,
        embedding_dim: int | None = None,
    ) -> Index:
        """Embed a folder of images (``images``) or a dataset split into the index at ``path`` (created, or resumed and
        appended to when it exists: only items not in it yet are embedded; an index of another model is refused), then
        bring its ANN structure up to date as ``vlfit retrieve index`` does (``index_type``: ``auto``, ``flat``,
        ``hnsw`` or ``ivfpq``; needs the serve extra). ``shard_size``, ``index_type``, ``max_index_memory`` and
        ``target_recall`` left None are those the index was built with (of a new index: 4096, ``auto``, 4 GiB, 0.95).
        ``vector_storage`` ``int8`` or ``binary`` keeps compact codes that queries scan, re-scoring the top ``rescore``
        x k with the shards' float32 vectors (left None: as built, of a new index ``float32``, and the factor tuned to
        ``target_recall``). ``embedding_dim`` cuts a model given by name to that many dimensions (``vlfit.load``'s; an
        index holds one size). A dataset's rows that show one image (one ``image_id_column`` value, one row of a list
        caption column, or identical bytes) are one item with all their captions, as evaluation groups them."""
        from vlfit.index.job import IndexJob, index_collection
        from vlfit.index.store import EmbeddingIndex

        if not isinstance(model, str) and embedding_dim not in (None, model.embedding_dim):
            raise ConfigError(f"--embedding_dim {embedding_dim}: the model given embeds into {model.embedding_dim} "
                              "dimensions; load it with that size (vlfit.load(..., embedding_dim=))")  # fmt: skip
        # Every value is checked as the job is made, before the model loads.
        job = IndexJob(
            model if isinstance(model, str) else model.encoder, path, images=images, dataset_name=dataset_name,
            split=split, image_column=image_column, caption_column=caption_column, image_id_column=image_id_column,
            batch_size=batch_size, num_workers=num_workers, shard_size=shard_size, progress=progress, verify=verify,
            index_type=index_type, max_index_memory=max_index_memory, target_recall=target_recall,
            vector_storage=vector_storage, rescore=rescore, runtime=RuntimeSettings(embedding_dim=embedding_dim),
        )  # fmt: skip
        if isinstance(model, str):  # appended to at the patch budget and size it was built with
            runtime = job.replayed(EmbeddingIndex.existing(path)).runtime
            model = load(model, max_num_patches=runtime.max_num_patches, embedding_dim=runtime.embedding_dim)
            job = dataclasses.replace(job, model=model.encoder)
        index_collection(job).raise_for_failures()
        return cls(path, model)

    @classmethod
    @python_api(renames={"index": "path"})
    def open(cls, path: str, model: Model | None = None, verify: str = "quick") -> Index:
        """The index at ``path``, checked against its manifest (``verify``: ``quick`` or ``full``, as ``vlfit
        retrieve verify`` checks it); queries are embedded with ``model`` (default: the one it was built with).
        ``path`` may name a vector database an index was pushed to (``lancedb:PATH``, ``qdrant:PATH``,
        ``chroma:PATH``, ``postgresql://...``, ``milvus:PATH.db``, each ``[#collection]``)."""
        index = cls(path, model, verify)
        if model is not None:
            model.encoder.check_embeds_into(index._index.manifest.identity, f"the index {path}")
        return index

    @python_api(renames={"index": "path"})
    def append(self, progress: bool = False, batch_size: int = 32, num_workers: int = 0) -> int:
        """Embed what the index's folder or dataset holds that the index does not yet, with the settings it was
        built with (its columns, shard size, ANN type and parameters, as ``vlfit retrieve index`` appends do);
        returns how many were added."""
        from vlfit.data.sources.openers import COLLECTION_KEYS

        last = self._index.manifest.collections[-1]  # what the latest build embedded, opened again
        before = len(self._index)
        Index.build(
            self.model, self.path, **{key: last[key] for key in COLLECTION_KEYS if key in last}, progress=progress,
            batch_size=batch_size, num_workers=num_workers,
        )  # fmt: skip
        self._reload()
        return len(self._index) - before

    @python_api(renames={"to": "uri"})
    def push(
        self,
        uri: str,
        *,
        overwrite: bool = False,
        delete_missing: bool = False,
        batch_size: int | None = None,
        progress: bool = False,
    ) -> dict[str, object]:
        """Push the index to the vector database ``uri`` as ``vlfit retrieve push --to URI`` does (items already
        there skipped unless ``overwrite``; ``delete_missing`` removes those the index does not hold); returns its
        report (``pushed``, ``skipped``, ``deleted``, ``total``, ...)."""
        from vlfit.index.push.job import push_index
        from vlfit.index.push.pushed import PushedIndex

        if isinstance(self._index, PushedIndex):
            raise ConfigError(f"{self.path} is a pushed collection: push the index folder it came from")
        report = push_index(self._index, uri, overwrite=overwrite, delete_missing=delete_missing,
                            batch_size=batch_size, progress=progress)  # fmt: skip
        return report.to_dict()

    @python_api(renames={"index": "path", "rerank_top_k": "rerank"})
    def search(
        self,
        queries: str | Sequence[str] | np.ndarray,
        k: int = 10,
        rerank: int | None = None,
        rerank_score: str | None = None,
        rerank_weight: float | None = None,
    ) -> list[SearchHit] | list[list[SearchHit]]:
        """The ``k`` best items for a text (a list of ``SearchHit``), for several texts or for query embeddings
        ``[Q, D]`` (a list of lists), best first.

        ``rerank``: re-rank each text's top ``rerank`` candidates by the model's image-text matching head (BridgeTower
        trained with ``--objective contrastive+itm``, or its export) and keep ``k`` of them; re-ranked hits carry
        ``match_score``. It reads the candidates' images, so the index must reach them (an image folder, a dataset).
        ``rerank_score``: ``itm`` (the log-odds alone) or ``itm+itc`` (plus ``rerank_weight`` times the cosine, the
        hits then carry ``fused_score``); by default ``itm+itc`` with the weight the run saved, ``itm`` without one.
        """
        from vlfit.index.push.pushed import PushedIndex
        from vlfit.index.rerank import Reranker, check_rerank_top_k
        from vlfit.index.search import search

        check_at_least("k", k, 1)
        check_rerank_top_k(rerank, "--rerank")
        by = self.model.runtime.rerank_score(rerank_score, rerank_weight) if rerank is not None else None
        single = isinstance(queries, str)
        texts: list[str] = []
        if isinstance(queries, np.ndarray):
            if rerank is not None:
                raise ConfigError("--rerank scores texts against images: pass the query texts, not embeddings")
            embeddings = torch.from_numpy(self._query_embeddings(queries))
        else:
            texts = text_list("queries", queries)
            embeddings = torch.from_numpy(self.model.encode_texts(texts))  # a view: no copy
        if isinstance(self._index, PushedIndex):  # a pushed collection: its engine searches
            if rerank is not None:
                raise ConfigError(f"--rerank reads the candidates' images, which {self.path} does not hold")
            results = self._index.search(embeddings, k)
        else:
            results = search(self._index, embeddings, max(k, rerank or 0))
        if rerank is not None:
            if self._reranker is None:
                self._reranker = Reranker.beside(self.model.runtime, self._index)
            results = self._reranker.rerank(results, texts, rerank, k, by)
        return results[0] if single else results

    def _query_embeddings(self, queries: np.ndarray) -> np.ndarray:
        """Query embeddings ``[Q, D]`` (one ``[D]`` alone: one query), checked against the index's size."""
        dim = self._index.manifest.identity.embedding_size
        array = np.atleast_2d(queries)
        if array.ndim != 2 or array.shape[1] != dim or not np.issubdtype(array.dtype, np.number):
            raise DataError(
                f"--queries: embeddings must be numbers of shape [Q, {dim}] (or [{dim}]) for this index, got "
                f"{queries.dtype} {list(queries.shape)}"
            )
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise DataError("--queries: embeddings hold NaN or infinite values")
        return array
