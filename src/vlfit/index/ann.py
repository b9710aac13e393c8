"""Approximate nearest neighbours on faiss: building the structure ``vlfit.index.ann_choice`` chooses, tuning it, saving
and loading it, searching it.

PQ codes rank coarsely: however many lists an IVF-PQ search visits, its top 10 holds only part of the exact top 10 (0.72
of it at 10^6 vectors with 64-byte codes). So an IVF-PQ index re-ranks: it asks faiss for ``rerank`` times ``k``
candidates, reads their full vectors from the index's memory-mapped shards (``vectors``, the store of record,
``vlfit.index.store.ShardVectors``) and keeps the ``k`` of highest exact score. The structure in memory stays within its
budget; a query reads ``rerank * k`` vectors from the shards.

``build_ann`` trains on the embeddings (a sample of many), adds them, then tunes the search until recall@10 against
exact search reaches the target: ``efSearch`` of HNSW; ``nprobe`` and ``rerank`` of IVF-PQ (the fastest pair that
reaches it); the ``rerank`` of compact codes (``--vector_storage int8`` or ``binary``) unless ``--rescore`` fixed it.
Recall is measured on a seeded sample of the indexed vectors as queries, each query's own row left out of both its exact
and its found neighbours (an indexed vector is its own nearest neighbour, which would flatter every structure). Rows of
results are positions in the order the vectors were added (the shards' order); ``-1`` pads where fewer than ``k`` were
found. faiss is imported only inside functions: it is the ``serve`` extra.

``save`` records the size and SHA-256 of ``ann.faiss`` (computed as faiss writes it, the file flushed to disk before its
description is written); ``load`` reads it into memory, hashing it as faiss reads it, and refuses a file that is not the
one recorded. Searches never read the file again: one replaced or overwritten underneath cannot take a server down (a
memory-mapped IVF index did, with SIGBUS), and a reload opens the new file whole.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any

import numpy as np

from vlfit.atomic_files import write_file_atomically, write_text_atomically
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.extras import require_extra
from vlfit.index.ann_choice import (
    DEFAULT_MAX_INDEX_MEMORY,
    DEFAULT_TARGET_RECALL,
    check_target_recall,
    choose_index_type,
    ivf_training_size,
    rescore_factors,
    rescore_setting,
    storage_choice,
)
from vlfit.index.ann_file import read_hashed
from vlfit.index.integrity import DamagedIndexError, sha256_problem

RETRAIN_GROWTH = 4  # an IVF index trained on n vectors is retrained once it holds more than 4n
RECALL_K = 10
TUNING_QUERIES = 1000
LATENCY_QUERIES = 100
ANN_FILE = "ann.faiss"
ANN_DESCRIPTION = "ann.json"
# The search parameter tuned per type, and the values tried in order.
EF_SEARCH = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
# IVF-PQ: candidates read back from the shards per result wanted, tried in order (1: no re-ranking).
RERANK_FACTORS = (1, 2, 4, 8, 16, 32)
PLATEAU = 0.002  # a larger search parameter that gains less recall than this ends its sweep


def _faiss(what: str = "vlfit retrieve index"):
    """The faiss module, or a one-line ``MissingExtraError`` naming the ``serve`` extra."""
    require_extra("serve", what, modules=("faiss",))
    import faiss

    return faiss


def _as_vectors(embeddings: Any) -> np.ndarray:
    vectors = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32))
    if vectors.ndim != 2:
        raise DataError(f"embeddings must be [N, D], got shape {vectors.shape}")
    return vectors


def sign_bits(vectors: np.ndarray) -> np.ndarray:
    """Each vector's sign bits, packed 8 to a byte (``[N, ceil(D / 8)]`` uint8; the last byte's unused bits 0)."""
    return np.packbits(vectors > 0, axis=1)


def recall_at_k(found: np.ndarray, expected: np.ndarray) -> float:
    """The mean share of each row of ``expected`` (exact top-k rows) that ``found`` holds."""
    hits = [len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(found, expected, strict=True)]
    return float(np.mean(hits) / expected.shape[1]) if len(hits) else 1.0


class AnnIndex:
    """A faiss index over embeddings, with what is known of it (``describe()``).

    Args:
        index: The faiss index.
        description: Its type, factory, build and search parameters, measured recall, size and latency.
        vectors: The full vectors by row (``vectors[rows] -> [n, D]``): what an IVF-PQ index re-ranks its
            candidates with (``EmbeddingIndex.vectors()``, or the embeddings array).
    """

    def __init__(self, index: Any, description: dict[str, Any], vectors: Any = None) -> None:
        self.index = index
        self.description = description
        self.vectors = vectors
        self._apply_search_params()

    @property
    def type(self) -> str:
        return str(self.description["type"])

    @property
    def rerank(self) -> int:
        """Candidates re-scored exactly per result wanted (1: faiss's ranking, but compact codes: ``rescores``)."""
        return int(self.description.get("rerank", 1))

    @property
    def binary(self) -> bool:  # sign bits in a faiss binary index (--vector_storage binary)
        return self.type == "binary"

    @property
    def rescores(self) -> bool:  # a search re-scores its candidates with the full vectors
        return self.rerank > 1 or self.type in ("int8", "binary")

    def _codes(self, vectors: np.ndarray) -> np.ndarray:
        """What the faiss index takes of ``vectors``: themselves, or their sign bits."""
        return sign_bits(vectors) if self.binary else vectors

    def __len__(self) -> int:
        return int(self.index.ntotal)

    @property
    def needs_retrain(self) -> bool:
        """An IVF index holds more than ``RETRAIN_GROWTH`` times what it was trained on: its lists are stale."""
        return self.type == "ivfpq" and len(self) > RETRAIN_GROWTH * int(self.description["trained_on"])

    def describe(self) -> dict[str, Any]:
        return {**self.description, "count": len(self), "needs_retrain": self.needs_retrain}

    def _apply_search_params(self) -> None:
        params = self.description.get("search_params") or {}
        if params:
            faiss = _faiss()
            faiss.ParameterSpace().set_index_parameters(self.index, ",".join(f"{k}={v}" for k, v in params.items()))

    def _search_parameters(self, selector: Any) -> Any:
        faiss = _faiss()
        params = self.description.get("search_params") or {}
        if self.type == "hnsw":
            return faiss.SearchParametersHNSW(sel=selector, efSearch=int(params.get("efSearch", 16)))
        if self.type == "ivfpq":
            quantizer = faiss.SearchParametersHNSW(efSearch=int(params.get("quantizer_efSearch", 64)))
            return faiss.SearchParametersIVF(
                sel=selector, nprobe=int(params.get("nprobe", 1)), quantizer_params=quantizer
            )
        return faiss.SearchParameters(sel=selector)

    def search(self, queries: Any, k: int, exclude: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best rows for each query, best first.

        Args:
            queries: ``[Q, D]`` float32 embeddings.
            k: Results per query.
            exclude: Rows never to return (items removed from the collection).

        Returns:
            ``(scores [Q, k], rows [Q, k])``; rows past what was found are ``-1`` (score ``-inf``). Re-ranked
            scores are the exact cosines.

        Raises:
            ConfigError: when the index re-ranks and was opened without its vectors.
        """
        queries = _as_vectors(queries)
        if self.rescores and self.vectors is None:
            raise ConfigError(
                f"this {self.type} index re-ranks its candidates with the full vectors: open it with its vectors "
                "(vlfit.index.ann_update.open_ann, or AnnIndex.load(folder, vectors=...))"
            )
        wanted = max(k, min(len(self), k * self.rerank)) if self.rescores else k
        if exclude is None or len(exclude) == 0:
            scores, rows = self.index.search(self._codes(queries), wanted)
        else:
            faiss = _faiss()
            batch = faiss.IDSelectorBatch(np.asarray(exclude, dtype=np.int64))
            selector = faiss.IDSelectorNot(batch)  # ``batch`` stays referenced while faiss reads it
            scores, rows = self.index.search(self._codes(queries), wanted, params=self._search_parameters(selector))
        if self.rescores:
            return self._rerank(queries, rows, k)
        return scores, rows

    def _rerank(self, queries: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` of ``rows`` (candidates ``[Q, C]``, ``-1`` for none) with the highest exact score."""
        found = rows >= 0
        unique, inverse = np.unique(np.where(found, rows, 0), return_inverse=True)
        candidates = np.asarray(self.vectors[unique], dtype=np.float32)[inverse.reshape(rows.shape)]  # [Q, C, D]
        exact = np.einsum("qcd,qd->qc", candidates, queries)
        exact[~found] = -np.inf
        order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        best = np.take_along_axis(exact, order, axis=1)
        return best, np.where(np.isfinite(best), np.take_along_axis(rows, order, axis=1), -1)

    def add(self, embeddings: Any) -> None:
        """Append vectors (rows continue from ``len(self)``); an IVF index then may report ``needs_retrain``."""
        self.index.add(self._codes(_as_vectors(embeddings)))

    def tune(self, embeddings: Any, target_recall: float = DEFAULT_TARGET_RECALL, seed: int = 0) -> dict[str, Any]:
        """Find the fastest search settings whose recall@10 reaches ``target_recall``; record recall, size, latency.

        HNSW raises ``efSearch``; IVF-PQ raises ``nprobe`` for each re-ranking factor in turn (a larger factor needs
        no more lists than a smaller one did) and keeps the pair with the lowest median query latency. A sweep ends
        once a larger parameter gains less than ``PLATEAU``. When no setting reaches the target, the one of highest
        recall is kept and ``reached_target`` is False.

        Args:
            embeddings: Every indexed vector ``[N, D]``, in row order (the exact answers are computed on them, and
                re-ranking reads them unless the index has its vectors already).
            target_recall: The recall@10 to reach.
            seed: Draws the query sample (up to ``TUNING_QUERIES`` indexed vectors).

        Returns:
            ``describe()``.
        """
        faiss = _faiss()
        vectors = _as_vectors(embeddings)
        if len(vectors) != len(self):
            raise DataError(f"tuning needs the {len(self)} indexed vectors, got {len(vectors)}")
        if self.vectors is None:
            self.vectors = vectors
        rng = np.random.default_rng(seed)
        own = np.sort(rng.choice(len(vectors), min(TUNING_QUERIES, len(vectors)), replace=False))
        queries = vectors[own]
        k = min(RECALL_K, len(vectors) - 1)
        expected = None
        if k >= 1:
            exact = faiss.IndexFlatIP(vectors.shape[1])
            exact.add(vectors)
            expected = _leave_out(exact.search(queries, k + 1)[1], own, k)

        def recall_of(params: dict[str, int], rerank: int) -> float:
            self._set(params, rerank)
            if expected is None:
                return 1.0
            return recall_at_k(_leave_out(self.search(queries, k + 1)[1], own, k), expected)

        reached: list[tuple[float, float, dict[str, int], int]] = []  # (latency, recall, params, rerank)
        best: tuple[float, dict[str, int], int] | None = None
        limit = None
        for rerank, sweep in self._sweeps():
            if reached and self.description.get("rescore_tuned"):
                break  # tuned compact codes: a larger factor only re-scores more candidates
            previous = -1.0
            for position, params in enumerate(sweep[:limit]):
                recall = recall_of(params, rerank)
                if best is None or recall > best[0]:
                    best = (recall, params, rerank)
                if recall >= target_recall:
                    reached.append((self._latency(queries, max(k, 1)), recall, params, rerank))
                    limit = position + 1
                    break
                if recall - previous < PLATEAU:
                    break
                previous = recall
        assert best is not None
        if reached:
            latency, recall, params, rerank = min(reached, key=lambda option: option[0])
            self._set(params, rerank)
        else:
            recall, params, rerank = best
            self._set(params, rerank)
            latency = self._latency(queries, max(k, 1))
        self.description.update(
            recall_at_10=round(recall, 4),
            target_recall=target_recall,
            reached_target=bool(reached),
            bytes_per_vector=round(self._serialized(faiss).nbytes / len(self), 2),
            query_latency_ms=round(latency, 4),
            tuned_on=len(queries),
        )
        return self.describe()

    def _serialized(self, faiss: Any) -> np.ndarray:
        return faiss.serialize_index_binary(self.index) if self.binary else faiss.serialize_index(self.index)

    def _set(self, params: dict[str, int], rerank: int) -> None:
        self.description["search_params"] = params
        self.description["rerank"] = rerank
        self._apply_search_params()

    def _latency(self, queries: np.ndarray, k: int) -> float:
        """The median milliseconds of one query, as served (re-ranking included)."""
        latencies = []
        for query in queries[:LATENCY_QUERIES]:
            start = time.perf_counter()
            self.search(query[None], k)
            latencies.append((time.perf_counter() - start) * 1000)
        return statistics.median(latencies)

    def _sweeps(self) -> list[tuple[int, list[dict[str, int]]]]:
        """``(rerank, search parameters in increasing order)`` to try, per re-ranking factor."""
        if self.type == "hnsw":
            return [(1, [{"efSearch": ef} for ef in EF_SEARCH])]
        if self.type == "ivfpq":
            nlist = int(self.description["params"]["nlist"])
            probes = sorted({min(2**i, nlist) for i in range(int(math.log2(nlist)) + 2)})
            sweep = [{"nprobe": p, "quantizer_efSearch": max(64, 2 * p)} for p in probes]
            return [(rerank, sweep) for rerank in RERANK_FACTORS]
        tuned = self.description.get("rescore_tuned")  # compact codes without --rescore: each factor in turn
        return [(factor, [{}]) for factor in (rescore_factors(self.type) if tuned else (self.rerank,))]

    def save(self, folder: str) -> dict[str, Any]:
        """Write ``ann.faiss``, then ``ann.json`` (its description, with the file's ``bytes`` and ``sha256``), each
        atomically and flushed to disk; returns the description."""
        faiss = _faiss()
        os.makedirs(folder, exist_ok=True)

        def write(f: Any) -> None:
            (faiss.write_index_binary if self.binary else faiss.write_index)(
                self.index, faiss.PyCallbackIOWriter(f.write)
            )

        written = write_file_atomically(os.path.join(folder, ANN_FILE), write)
        described = {**self.describe(), "file": ANN_FILE, **written.to_dict()}
        text = json.dumps(described, indent=1) + "\n"
        write_text_atomically(os.path.join(folder, ANN_DESCRIPTION), text, durable=True)
        return described

    @classmethod
    def load(
        cls,
        folder: str,
        mmap: bool = False,
        what: str = "vlfit retrieve query",
        vectors: Any = None,
        *,
        recorded: dict[str, Any] | None = None,
        repair: str = "vlfit retrieve index",
    ) -> AnnIndex:
        """The ANN index ``save`` wrote in ``folder``, read into memory (its size and SHA-256 checked against
        ``recorded``, else against ``ann.json``, as faiss reads it).

        Args:
            folder: The index folder.
            mmap: Memory-map an IVF index rather than read it (every search then reads the file: one overwritten
                underneath kills the process with SIGBUS; only for a file nothing rewrites).
            what: The command named if faiss is missing.
            vectors: The full vectors by row, which a re-ranking index searches with.
            recorded: The description the index manifest holds (its ``bytes`` and ``sha256`` of ``ann.faiss``).
            repair: The command that rebuilds a damaged file, for the message.

        Raises:
            MissingFileError: when the folder holds none.
            DamagedIndexError: when ``ann.faiss`` is not the file recorded, does not parse, or does not hold what
                ``ann.json`` says (a write was interrupted, or the file was changed since).
        """
        faiss = _faiss(what)
        description_path = os.path.join(folder, ANN_DESCRIPTION)
        path = os.path.join(folder, ANN_FILE)
        if not os.path.isfile(description_path) or not os.path.isfile(path):
            raise MissingFileError(f"{folder}: no {ANN_FILE}; build one with vlfit retrieve index")
        try:
            with open(description_path, encoding="utf-8") as f:
                description = dict(json.load(f))
            if "type" not in description or "count" not in description:
                raise ValueError("no type or count")
        except (ValueError, KeyError, TypeError) as err:
            raise DamagedIndexError(description_path, f"does not parse ({type(err).__name__}: {err})", repair) from None
        recorded = recorded or description
        if mmap and description["type"] == "ivfpq":
            index = faiss.read_index(path, faiss.IO_FLAG_MMAP)
        else:
            index, found = read_hashed(faiss, path, repair, description["type"] == "binary")
            problem = sha256_problem(found, recorded)
            if problem:
                raise DamagedIndexError(path, problem, repair)
        if index.ntotal != description["count"]:
            problem = f"holds {index.ntotal} vectors but {ANN_DESCRIPTION} says {description['count']}"
            raise DamagedIndexError(path, problem, repair)
        return cls(index, description, vectors)


def _leave_out(rows: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """Each row of neighbours ``[Q, k + 1]`` without the query's own row ``own[q]``, cut to ``k``."""
    kept = np.full((len(rows), k), -1, dtype=np.int64)
    for q, (row, itself) in enumerate(zip(rows.tolist(), own.tolist(), strict=True)):
        others = [r for r in row if r != itself][:k]
        kept[q, : len(others)] = others
    return kept


def build_ann(
    embeddings: Any,
    index_type: str = "auto",
    max_index_memory: int | None = None,
    target_recall: float = DEFAULT_TARGET_RECALL,
    seed: int = 0,
    storage: str = "float32",
    rescore: int | None = None,
) -> AnnIndex:
    """Choose, train, fill and tune an ANN index over ``embeddings`` (L2-normalized ``[N, D]``).

    Args:
        embeddings: The vectors, in row order.
        index_type: ``auto``, ``flat``, ``hnsw`` or ``ivfpq`` (``choose_index_type``).
        max_index_memory: Bytes the structure may take (default ``DEFAULT_MAX_INDEX_MEMORY``).
        target_recall: The recall@10 against exact search that the search parameter is raised to reach.
        seed: Draws the training and tuning samples.
        storage: ``float32`` (the structure ``index_type`` names), or a flat scan of ``int8`` or ``binary`` codes.
        rescore: Compact codes: candidates re-scored exactly with the full vectors per result wanted (None: tuned,
            the smallest of ``rescore_factors(storage)`` that reaches ``target_recall``).

    Raises:
        ConfigError: for a type, storage or budget that does not fit the collection.
    """
    check_target_recall(target_recall)
    if rescore is not None and rescore < 1:
        raise ConfigError(f"--rescore must be at least 1, got {rescore}")
    faiss = _faiss()
    vectors = _as_vectors(embeddings)
    dim = vectors.shape[1]
    compact = storage_choice(len(vectors), dim, storage, max_index_memory, index_type)
    choice = compact or choose_index_type(len(vectors), dim, max_index_memory, index_type)
    if choice.type == "binary":
        index = faiss.IndexBinaryFlat(8 * int(choice.bytes_per_vector))
    else:
        index = faiss.index_factory(dim, choice.factory, faiss.METRIC_INNER_PRODUCT)
    trained_on = len(vectors)
    if choice.type == "int8":
        index.train(vectors)  # each dimension's range
    if choice.type == "ivfpq":
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        ivf.do_polysemous_training = False  # the factory's default; only Hamming-filtered search uses it, at ~10x
        trained_on = ivf_training_size(len(vectors), choice.params["nlist"])
        sample = np.random.default_rng(seed).choice(len(vectors), trained_on, replace=False)
        ivf.cp.seed = ivf.pq.cp.seed = seed
        index.train(vectors[np.sort(sample)])
    index.add(sign_bits(vectors) if choice.type == "binary" else vectors)
    description = {
        "type": choice.type,
        "factory": choice.factory,
        "params": choice.params,
        "expected_bytes_per_vector": round(choice.bytes_per_vector, 2),
        "max_index_memory": DEFAULT_MAX_INDEX_MEMORY if max_index_memory is None else max_index_memory,
        "trained_on": trained_on,
        "search_params": {},
        **(rescore_setting(storage, rescore) if compact else {}),
    }
    ann = AnnIndex(index, description)
    ann.tune(vectors, target_recall, seed)
    return ann


__all__ = ["AnnIndex", "build_ann", "recall_at_k", "sign_bits"]
