"""Which approximate-nearest-neighbour structure fits a collection: sized by arithmetic alone, without faiss.

Embeddings are L2-normalized float32, so the inner product faiss ranks by is the cosine. Three structures, chosen as
autofaiss chooses (``choose_index_type``):

* ``flat``: exact, every vector scanned (``Flat``); below ``FLAT_THRESHOLD`` vectors it is fast enough.
* ``hnsw``: a graph over the full vectors (``HNSW32``) while vectors plus links fit ``max_index_memory``.
* ``ivfpq``: ``IVF{nlist}_HNSW32,PQ{m}x8``: ``nlist`` ~ 4 sqrt(N) inverted lists found through an HNSW graph of their
  centroids, each vector kept as an ``m``-byte product-quantization code, ``m`` as large as the budget allows.

With ``--vector_storage int8`` or ``binary`` the structure is a flat scan of compact codes instead (``storage_choice``),
each query's top ``--rescore`` x k candidates re-scored exactly with the float32 vectors the shards keep (without
``--rescore``, the smallest of ``rescore_factors(storage)`` whose recall@10 reaches ``--target_recall``):

* ``int8``: faiss's scalar quantizer ``SQ8``, one byte per dimension, each dimension's range (its minimum and
  maximum over the vectors) trained on them: per dimension, not one symmetric scale (4x smaller than float32).
* ``binary``: one sign bit per dimension (``IndexBinaryFlat``, ranked by Hamming distance; 32x smaller).

Building, tuning and searching the structure chosen is ``vlfit.index.ann``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vlfit.errors import ConfigError

INDEX_TYPES = ("auto", "flat", "hnsw", "ivfpq")
VECTOR_STORAGES = ("float32", "int8", "binary")
DEFAULT_RESCORE = 4  # int8 and binary: candidates re-scored exactly per result wanted
# Per storage, the first factor tuning tries: sign bits rank coarser than 8-bit codes. On 10^5 clustered 512-d
# vectors (benchmarks/smaller_vectors.py) binary kept recall@10 0.517 at x4 and 1.000 at x32; int8 1.000 at x4. The
# candidates a Hamming scan ranks first crowd as the collection grows: at 10^6 binary needed x128 (0.515 at x32,
# 0.80 at x64), so tuning doubles the factor up to RESCORE_DOUBLINGS times until the target recall is reached.
STORAGE_RESCORE = {"int8": DEFAULT_RESCORE, "binary": 32}
RESCORE_DOUBLINGS = 3
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


@dataclass(frozen=True)
class IndexChoice:
    """The structure for a collection.

    Attributes:
        type: ``flat``, ``hnsw``, ``ivfpq``, or a compact storage's ``int8`` or ``binary``.
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
    check_index_type(index_type)
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


def storage_choice(
    num_vectors: int, dim: int, storage: str, max_index_memory: int | None = None, index_type: str = "auto"
) -> IndexChoice | None:
    """The flat scan of ``int8`` or ``binary`` codes for ``num_vectors`` vectors of size ``dim`` (None for
    ``float32``: ``choose_index_type`` chooses).

    Raises:
        ConfigError: for an unknown storage, an ``index_type`` other than ``auto`` or ``flat`` beside a compact one
            (its codes are scanned whole), or codes that do not fit ``max_index_memory``.
    """
    check_vector_storage(storage, index_type)
    if storage == "float32":
        return None
    per_vector = dim if storage == "int8" else -(-dim // 8)
    choice = IndexChoice(storage, "SQ8" if storage == "int8" else f"BFlat{8 * per_vector}", {}, float(per_vector))
    budget = DEFAULT_MAX_INDEX_MEMORY if max_index_memory is None else max_index_memory
    if num_vectors * per_vector > budget:
        raise ConfigError(f"--vector_storage {storage} needs about {num_vectors * per_vector} bytes for {num_vectors} "
                          f"vectors, over --max_index_memory {budget}; raise it or use float32 with ivfpq")  # fmt: skip
    return choice


def check_vector_storage(storage: str, index_type: str = "auto") -> None:
    """Raises ``ConfigError`` unless ``storage`` is one of ``VECTOR_STORAGES``, and a compact one goes with
    ``index_type`` ``auto`` or ``flat``."""
    if storage not in VECTOR_STORAGES:
        raise ConfigError(f"unknown --vector_storage {storage!r}; choose one of: {', '.join(VECTOR_STORAGES)}")
    if storage != "float32" and index_type not in ("auto", "flat"):
        raise ConfigError(f"--vector_storage {storage} scans every code (a flat index re-scored from the shards); "
                          f"--index_type {index_type} is for float32 vectors: leave it out or use flat")  # fmt: skip


def check_index_type(index_type: str) -> None:
    """Raises ``ConfigError`` unless ``index_type`` is one of ``INDEX_TYPES``."""
    if index_type not in INDEX_TYPES:
        raise ConfigError(f"unknown --index_type {index_type!r}; choose one of: {', '.join(INDEX_TYPES)}")


def rescore_factors(storage: str) -> tuple[int, ...]:
    """The re-scoring factors tuning tries for ``storage`` (``int8`` or ``binary``), smallest first."""
    first = STORAGE_RESCORE.get(storage, DEFAULT_RESCORE)
    return tuple(first * 2**doubling for doubling in range(RESCORE_DOUBLINGS + 1))


def rescore_setting(storage: str, rescore: int | None) -> dict[str, int | bool]:
    """A compact structure's description entries for ``--rescore`` (None: tuned from the storage's first factor)."""
    if rescore is None:
        return {"rerank": rescore_factors(storage)[0], "rescore_tuned": True}
    return {"rerank": rescore, "rescore_tuned": False}


def check_target_recall(target_recall: float) -> None:
    """Raises ``ConfigError`` unless ``0 < target_recall <= 1``."""
    if not 0 < target_recall <= 1:
        raise ConfigError(f"--target_recall must be in (0, 1], got {target_recall}")


__all__ = [
    "DEFAULT_MAX_INDEX_MEMORY",
    "DEFAULT_RESCORE",
    "STORAGE_RESCORE",
    "DEFAULT_TARGET_RECALL",
    "INDEX_TYPES",
    "VECTOR_STORAGES",
    "IndexChoice",
    "check_index_type",
    "check_vector_storage",
    "check_target_recall",
    "rescore_factors",
    "rescore_setting",
    "choose_index_type",
    "storage_choice",
]
