"""Approximate nearest neighbours on faiss: which structure fits a collection, building and tuning it, searching it.

Embeddings are L2-normalized float32, so the inner product faiss ranks by is the cosine. Three structures, chosen as
autofaiss chooses (``choose_index_type``):

* ``flat``: exact, every vector scanned (``Flat``); below ``FLAT_THRESHOLD`` vectors it is fast enough.
* ``hnsw``: a graph over the full vectors (``HNSW32``) while vectors plus links fit ``max_index_memory``.
* ``ivfpq``: ``IVF{nlist}_HNSW32,PQ{m}x8``: ``nlist`` ~ 4 sqrt(N) inverted lists found through an HNSW graph of their
  centroids, each vector kept as an ``m``-byte product-quantization code, ``m`` as large as the budget allows.

``build_ann`` trains on the embeddings themselves (a sample when there are many), adds them, then raises the search
parameter (``efSearch`` of HNSW, ``nprobe`` of IVF) until recall@10 against exact search, measured on a seeded sample
of the indexed vectors as queries, reaches the target. Rows of results are positions in the order the vectors were
added (the shards' order); ``-1`` pads where fewer than ``k`` were found. faiss is imported only inside functions:
it is the ``serve`` extra.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlfit.atomic_files import replace_on_success, write_text_atomically
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.extras import require_extra

INDEX_TYPES = ("auto", "flat", "hnsw", "ivfpq")
DEFAULT_MAX_INDEX_MEMORY = 4 * 2**30
DEFAULT_TARGET_RECALL = 0.95
FLAT_THRESHOLD = 100_000  # below this many vectors an exact scan is fast enough (autofaiss's rule)
HNSW_M = 32  # graph links per vector (twice that on the bottom layer)
PQ_NBITS = 8  # bits per PQ sub-code: 256 centroids per sub-quantizer
MAX_PQ_M = 64  # more sub-quantizers buy little recall and cost search time
MIN_POINTS_PER_CENTROID = 39  # faiss warns below this many training points per k-means centroid
MIN_IVFPQ_VECTORS = MIN_POINTS_PER_CENTROID * 2**PQ_NBITS  # what the PQ codebooks need to train
TRAIN_POINTS_PER_LIST = 100  # training sample per inverted list (faiss samples 256 per centroid at most)
ID_BYTES = 8  # an IVF list stores each vector's int64 id beside its code
RETRAIN_GROWTH = 4  # an IVF index trained on n vectors is retrained once it holds more than 4n
RECALL_K = 10
TUNING_QUERIES = 1000
LATENCY_QUERIES = 100
ANN_FILE = "ann.faiss"
ANN_DESCRIPTION = "ann.json"
# The search parameter tuned per type, and the values tried in order.
EF_SEARCH = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)


def _faiss(what: str = "vlfit retrieve index"):
    """The faiss module, or a one-line ``MissingExtraError`` naming the ``serve`` extra."""
    require_extra("serve", what, modules=("faiss",))
    import faiss

    return faiss


@dataclass(frozen=True)
class IndexChoice:
    """The structure for a collection.

    Attributes:
        type: ``flat``, ``hnsw`` or ``ivfpq``.
        factory: The faiss ``index_factory`` string.
        params: Its build parameters (``M``; ``nlist``, ``m``, ``nbits``).
        bytes_per_vector: Expected memory per vector, fixed costs (centroids, codebooks) shared out.
    """

    type: str
    factory: str
    params: dict[str, int] = field(default_factory=dict)
    bytes_per_vector: float = 0.0


def flat_bytes(dim: int) -> int:
    """Bytes per vector of a flat index: the float32 vector."""
    return 4 * dim


def hnsw_bytes(dim: int, m: int = HNSW_M) -> int:
    """Bytes per vector of an HNSW index: the vector, 2M int32 links on the bottom layer (~1 above), a level and
    an offset."""
    return 4 * dim + 4 * (2 * m + 1) + 12


def ivf_lists(num_vectors: int) -> int:
    """Inverted lists for ``num_vectors``: about 4 sqrt(N), at most one per ``MIN_POINTS_PER_CENTROID`` vectors."""
    return max(1, min(round(4 * math.sqrt(num_vectors)), num_vectors // MIN_POINTS_PER_CENTROID))


def ivf_training_size(num_vectors: int, nlist: int) -> int:
    """How many vectors an IVF-PQ index trains on: enough for its lists and its PQ codebooks."""
    return min(num_vectors, max(TRAIN_POINTS_PER_LIST * nlist, TRAIN_POINTS_PER_LIST * 2**PQ_NBITS))


def ivfpq_fixed_bytes(dim: int, nlist: int) -> int:
    """What an IVF-PQ index holds whatever its size: the centroids in their HNSW graph, the PQ codebooks, and the
    lists' bookkeeping."""
    return nlist * hnsw_bytes(dim) + 2**PQ_NBITS * dim * 4 + nlist * 48


def _pq_sizes(dim: int) -> list[int]:
    """The numbers of sub-quantizers that divide ``dim``, largest first."""
    return [m for m in range(min(dim, MAX_PQ_M), 0, -1) if dim % m == 0]


def _ivfpq_choice(num_vectors: int, dim: int, max_index_memory: int) -> IndexChoice:
    if num_vectors < MIN_IVFPQ_VECTORS:
        raise ConfigError(
            f"--index_type ivfpq needs at least {MIN_IVFPQ_VECTORS} vectors to train its codebooks, the collection "
            f"has {num_vectors}; use hnsw or flat"
        )
    nlist = ivf_lists(num_vectors)
    fixed = ivfpq_fixed_bytes(dim, nlist)
    for m in _pq_sizes(dim):
        total = fixed + num_vectors * (m * PQ_NBITS // 8 + ID_BYTES)
        if total <= max_index_memory:
            params = {"nlist": nlist, "m": m, "nbits": PQ_NBITS}
            return IndexChoice("ivfpq", f"IVF{nlist}_HNSW{HNSW_M},PQ{m}x{PQ_NBITS}", params, total / num_vectors)
    smallest = fixed + num_vectors * (1 + ID_BYTES)
    raise ConfigError(
        f"--max_index_memory {max_index_memory} is too small for {num_vectors} vectors of size {dim}: the smallest "
        f"IVF-PQ index needs about {smallest} bytes"
    )


def choose_index_type(
    num_vectors: int, dim: int, max_index_memory: int | None = None, index_type: str = "auto"
) -> IndexChoice:
    """The structure for ``num_vectors`` vectors of size ``dim`` within ``max_index_memory`` bytes.

    ``auto`` follows autofaiss: exact ``flat`` below ``FLAT_THRESHOLD`` vectors, ``hnsw`` while vectors and links fit
    the budget, else ``ivfpq`` with the largest code that fits. A type named outright is sized the same way and
    refused when it cannot fit.

    Raises:
        ConfigError: for an unknown type, or a budget nothing (or the type named) fits in.
    """
    if index_type not in INDEX_TYPES:
        raise ConfigError(f"unknown --index_type {index_type!r}; choose one of: {', '.join(INDEX_TYPES)}")
    if num_vectors < 1 or dim < 1:
        raise ConfigError(f"an ANN index needs vectors, got {num_vectors} of size {dim}")
    budget = DEFAULT_MAX_INDEX_MEMORY if max_index_memory is None else max_index_memory
    flat = IndexChoice("flat", "Flat", {}, float(flat_bytes(dim)))
    hnsw = IndexChoice("hnsw", f"HNSW{HNSW_M}", {"M": HNSW_M}, float(hnsw_bytes(dim)))
    if index_type == "ivfpq":
        return _ivfpq_choice(num_vectors, dim, budget)
    for choice in (flat, hnsw):
        fits = num_vectors * choice.bytes_per_vector <= budget
        if index_type == choice.type:
            if not fits:
                raise ConfigError(
                    f"--index_type {choice.type} needs about {round(num_vectors * choice.bytes_per_vector)} bytes for "
                    f"{num_vectors} vectors, over --max_index_memory {budget}; raise it or use ivfpq"
                )
            return choice
        if index_type == "auto" and fits and (choice.type != "flat" or num_vectors < FLAT_THRESHOLD):
            return choice
    return _ivfpq_choice(num_vectors, dim, budget)


def check_target_recall(target_recall: float) -> None:
    """Raises ``ConfigError`` unless ``0 < target_recall <= 1``."""
    if not 0 < target_recall <= 1:
        raise ConfigError(f"--target_recall must be in (0, 1], got {target_recall}")


def _as_vectors(embeddings: Any) -> np.ndarray:
    vectors = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32))
    if vectors.ndim != 2:
        raise DataError(f"embeddings must be [N, D], got shape {vectors.shape}")
    return vectors


def recall_at_k(found: np.ndarray, expected: np.ndarray) -> float:
    """The mean share of each row of ``expected`` (exact top-k rows) that ``found`` holds."""
    hits = [len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(found, expected, strict=True)]
    return float(np.mean(hits) / expected.shape[1]) if len(hits) else 1.0


class AnnIndex:
    """A faiss index over embeddings, with what is known of it (``describe()``).

    Args:
        index: The faiss index.
        description: Its type, factory, build and search parameters, measured recall, size and latency.
    """

    def __init__(self, index: Any, description: dict[str, Any]) -> None:
        self.index = index
        self.description = description
        self._apply_search_params()

    @property
    def type(self) -> str:
        return str(self.description["type"])

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
            ``(scores [Q, k], rows [Q, k])``; rows past what was found are ``-1`` (score ``-inf``).
        """
        queries = _as_vectors(queries)
        if exclude is None or len(exclude) == 0:
            return self.index.search(queries, k)
        faiss = _faiss()
        batch = faiss.IDSelectorBatch(np.asarray(exclude, dtype=np.int64))
        selector = faiss.IDSelectorNot(batch)  # ``batch`` stays referenced while faiss reads it
        return self.index.search(queries, k, params=self._search_parameters(selector))

    def add(self, embeddings: Any) -> None:
        """Append vectors (rows continue from ``len(self)``); an IVF index then may report ``needs_retrain``."""
        self.index.add(_as_vectors(embeddings))

    def tune(self, embeddings: Any, target_recall: float = DEFAULT_TARGET_RECALL, seed: int = 0) -> dict[str, Any]:
        """Raise the search parameter until recall@10 reaches ``target_recall``, then record recall, size, latency.

        Args:
            embeddings: Every indexed vector ``[N, D]``, in row order (the exact answers are computed on them).
            target_recall: The recall@10 to reach (or the parameter's largest value, recorded as not reached).
            seed: Draws the query sample (up to ``TUNING_QUERIES`` indexed vectors).

        Returns:
            ``describe()``.
        """
        faiss = _faiss()
        vectors = _as_vectors(embeddings)
        if len(vectors) != len(self):
            raise DataError(f"tuning needs the {len(self)} indexed vectors, got {len(vectors)}")
        rng = np.random.default_rng(seed)
        queries = vectors[np.sort(rng.choice(len(vectors), min(TUNING_QUERIES, len(vectors)), replace=False))]
        k = min(RECALL_K, len(vectors))
        exact = faiss.IndexFlatIP(vectors.shape[1])
        exact.add(vectors)
        _, expected = exact.search(queries, k)
        space = faiss.ParameterSpace()
        recall, reached = 1.0, True
        for params in self._candidate_params():
            space.set_index_parameters(self.index, ",".join(f"{name}={value}" for name, value in params.items()))
            recall = recall_at_k(self.index.search(queries, k)[1], expected)
            self.description["search_params"] = params
            if recall >= target_recall:
                break
        else:
            reached = not self._candidate_params() or recall >= target_recall
        latencies = []
        for query in queries[:LATENCY_QUERIES]:
            start = time.perf_counter()
            self.index.search(query[None], k)
            latencies.append((time.perf_counter() - start) * 1000)
        self.description.update(
            recall_at_10=round(recall, 4),
            target_recall=target_recall,
            reached_target=reached,
            bytes_per_vector=round(faiss.serialize_index(self.index).nbytes / len(self), 2),
            query_latency_ms=round(statistics.median(latencies), 4),
            tuned_on=len(queries),
        )
        return self.describe()

    def _candidate_params(self) -> list[dict[str, int]]:
        if self.type == "hnsw":
            return [{"efSearch": ef} for ef in EF_SEARCH]
        if self.type == "ivfpq":
            nlist = int(self.description["params"]["nlist"])
            probes = sorted({min(2**i, nlist) for i in range(int(math.log2(nlist)) + 2)})
            return [{"nprobe": p, "quantizer_efSearch": max(64, 2 * p)} for p in probes]
        return []

    def save(self, folder: str) -> dict[str, Any]:
        """Write ``ann.faiss``, then ``ann.json`` (its description), each atomically; returns the description."""
        faiss = _faiss()
        os.makedirs(folder, exist_ok=True)
        with replace_on_success(os.path.join(folder, ANN_FILE)) as temp:
            faiss.write_index(self.index, temp)
        described = {**self.describe(), "file": ANN_FILE}
        write_text_atomically(os.path.join(folder, ANN_DESCRIPTION), json.dumps(described, indent=1) + "\n")
        return described

    @classmethod
    def load(cls, folder: str, mmap: bool = True, what: str = "vlfit retrieve query") -> AnnIndex:
        """The ANN index ``save`` wrote in ``folder``; an IVF index is memory-mapped unless ``mmap`` is False (which
        ``add`` needs).

        Raises:
            MissingFileError: when the folder holds none.
            DataError: when ``ann.faiss`` does not hold what ``ann.json`` says (a write was interrupted).
        """
        faiss = _faiss(what)
        description_path = os.path.join(folder, ANN_DESCRIPTION)
        if not os.path.isfile(description_path) or not os.path.isfile(os.path.join(folder, ANN_FILE)):
            raise MissingFileError(f"{folder}: no {ANN_FILE}; build one with vlfit retrieve index")
        with open(description_path, encoding="utf-8") as f:
            description = json.load(f)
        flags = faiss.IO_FLAG_MMAP if mmap and description["type"] == "ivfpq" else 0
        index = faiss.read_index(os.path.join(folder, ANN_FILE), flags)
        if index.ntotal != description["count"]:
            raise DataError(
                f"{folder}: {ANN_FILE} holds {index.ntotal} vectors but {ANN_DESCRIPTION} says {description['count']}; "
                "run vlfit retrieve index again to rebuild it"
            )
        return cls(index, description)


def build_ann(
    embeddings: Any,
    index_type: str = "auto",
    max_index_memory: int | None = None,
    target_recall: float = DEFAULT_TARGET_RECALL,
    seed: int = 0,
) -> AnnIndex:
    """Choose, train, fill and tune an ANN index over ``embeddings`` (L2-normalized ``[N, D]``).

    Args:
        embeddings: The vectors, in row order.
        index_type: ``auto``, ``flat``, ``hnsw`` or ``ivfpq`` (``choose_index_type``).
        max_index_memory: Bytes the structure may take (default ``DEFAULT_MAX_INDEX_MEMORY``).
        target_recall: The recall@10 against exact search that the search parameter is raised to reach.
        seed: Draws the training and tuning samples.

    Raises:
        ConfigError: for a type or budget that does not fit the collection.
    """
    check_target_recall(target_recall)
    faiss = _faiss()
    vectors = _as_vectors(embeddings)
    choice = choose_index_type(len(vectors), vectors.shape[1], max_index_memory, index_type)
    index = faiss.index_factory(vectors.shape[1], choice.factory, faiss.METRIC_INNER_PRODUCT)
    trained_on = len(vectors)
    if choice.type == "ivfpq":
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        ivf.do_polysemous_training = False  # the factory's default; only Hamming-filtered search uses it, at ~10x
        trained_on = ivf_training_size(len(vectors), choice.params["nlist"])
        sample = np.random.default_rng(seed).choice(len(vectors), trained_on, replace=False)
        ivf.cp.seed = ivf.pq.cp.seed = seed
        index.train(vectors[np.sort(sample)])
    index.add(vectors)
    description = {
        "type": choice.type,
        "factory": choice.factory,
        "params": choice.params,
        "expected_bytes_per_vector": round(choice.bytes_per_vector, 2),
        "max_index_memory": DEFAULT_MAX_INDEX_MEMORY if max_index_memory is None else max_index_memory,
        "trained_on": trained_on,
        "search_params": {},
    }
    ann = AnnIndex(index, description)
    ann.tune(vectors, target_recall, seed)
    return ann


__all__ = ["AnnIndex", "IndexChoice", "build_ann", "check_target_recall", "choose_index_type", "recall_at_k"]
