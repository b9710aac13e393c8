"""Smaller vectors at the same recall: embedding size (``--embedding_dim``) x storage (``--vector_storage``).

For each size (full, 1/2, 1/4, 1/8 of the embedding) and each storage (float32 scanned exactly, int8 and binary codes
scanned with the top ``--rescore`` x k re-scored from the float32 vectors; by default each storage's first factor in
``vlfit retrieve index``), as ``vlfit retrieve index`` builds the structure (``vlfit.index.ann.build_ann``):
recall@10 against exact float32 search at the full size, bytes per vector of what a query scans (the structure in
memory; the float32 shards stay on disk, memory-mapped, and a query reads ``rescore * k`` rows of them), and the
median latency of one query.

Vectors: by default ``--count`` synthetic unit vectors around 1000 random centres whose spread falls along the
dimensions (dimension i scaled by (i + 1) ** -0.5: the first dimensions carry most of the signal, as in a Matryoshka
or PCA-ordered embedding; plain random vectors would lose recall in proportion to the dimensions cut, which says
nothing about a trained model), and 200 fresh queries from the same mixture. ``--index FOLDER`` takes the vectors of
a vlfit index instead (the demo model's, say) and 200 of them, each left out of its own results, as queries.

    python benchmarks/smaller_vectors.py --count 100000
    python benchmarks/smaller_vectors.py --index runs/demo-index --json results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from bench_records import machine, rerun_command

from vlfit.index.ann import build_ann, recall_at_k
from vlfit.index.ann_choice import STORAGE_RESCORE

K = 10
QUERIES = 200
STORAGES = ("float32", "int8", "binary")


def synthetic(count: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` vectors and ``QUERIES`` fresh queries around 1000 centres, spread falling along the dimensions."""
    rng = np.random.default_rng(seed)
    scale = (np.arange(dim) + 1.0) ** -0.5
    centres = rng.standard_normal((1000, dim)) * scale

    def draw(n: int) -> np.ndarray:
        x = centres[rng.integers(0, len(centres), n)] + 0.7 * rng.standard_normal((n, dim)) * scale
        return x.astype(np.float32)

    return draw(count), draw(QUERIES)


def cut(vectors: np.ndarray, size: int) -> np.ndarray:
    """The first ``size`` dimensions, L2-normalized again (what ``--embedding_dim`` gives)."""
    part = vectors[:, :size]
    return np.ascontiguousarray(part / np.linalg.norm(part, axis=1, keepdims=True), dtype=np.float32)


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int, own: np.ndarray | None) -> np.ndarray:
    scores = queries @ vectors.T
    if own is not None:
        scores[np.arange(len(queries)), own] = -np.inf
    return np.argsort(-scores, axis=1)[:, :k]


def run(vectors: np.ndarray, queries: np.ndarray, own: np.ndarray | None, rescores: tuple[int | None, ...] = (None,),
        fractions: tuple[int, ...] = (1, 2, 4, 8), storages: tuple[str, ...] = STORAGES) -> list[dict]:  # fmt: skip
    """The rows of every size (the full size over each of ``fractions``) x storage; each compact storage once per
    factor of ``rescores`` (None: the first factor ``vlfit retrieve index`` tunes from, ``STORAGE_RESCORE``)."""
    full = vectors.shape[1]
    truth = exact_top(cut(vectors, full), cut(queries, full), K, own)
    rows = []
    for size in (full // fraction for fraction in fractions):
        base, asked = cut(vectors, size), cut(queries, size)
        settings = [(storage, rescore) for storage in storages for rescore in (rescores if storage != "float32" else
                                                                               (None,))]  # fmt: skip
        for storage, rescore in settings:
            factor = rescore or STORAGE_RESCORE.get(storage, 1)
            started = time.perf_counter()
            ann = build_ann(base, "flat", storage=storage, rescore=factor)
            built = time.perf_counter() - started
            wanted = K + (own is not None)
            latencies, found = [], []
            for q in range(len(asked)):
                start = time.perf_counter()
                _, hit = ann.search(asked[q : q + 1], wanted)
                latencies.append(1000 * (time.perf_counter() - start))
                kept = [r for r in hit[0].tolist() if own is None or r != own[q]][:K]
                found.append(kept + [-1] * (K - len(kept)))
            rows.append({
                "size": size, "storage": storage, "rescore": factor if storage != "float32" else None,
                "recall_at_10": round(recall_at_k(np.array(found), truth), 4),
                "bytes_per_vector": ann.description["bytes_per_vector"],
                "fraction_of_full_float32": round(ann.description["bytes_per_vector"] / (4 * full), 4),
                "query_p50_ms": round(statistics.median(latencies), 3), "build_s": round(built, 2),
            })  # fmt: skip
            shown = f"x{factor}" if storage != "float32" else ""
            print(f"d={size:>5} {storage:<8} {shown:<4} recall@10 {rows[-1]['recall_at_10']:.4f}  "
                  f"{rows[-1]['bytes_per_vector']:>8.2f} B/vector ({rows[-1]['fraction_of_full_float32']:.4f} of "
                  f"full float32)  p50 {rows[-1]['query_p50_ms']:.3f} ms", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="Synthetic vectors (without --index).")
    parser.add_argument("--dim", type=int, default=512, help="Synthetic embedding size (without --index).")
    parser.add_argument("--index", help="A vlfit index folder whose vectors to use instead.")
    parser.add_argument("--rescore", default=None, help="int8 and binary: candidates re-scored per result, or several "
                        "comma-separated (a row each; default: the first vlfit retrieve index tunes from, " + ", ".join(
                        f"{s} {n}" for s, n in STORAGE_RESCORE.items()) + ").")  # fmt: skip
    parser.add_argument("--fractions", default="1,2,4,8", help="Sizes: the full size over each of these.")
    parser.add_argument("--storages", default=",".join(STORAGES), help="Which of " + ", ".join(STORAGES) + ".")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="Write the rows here too.")
    args = parser.parse_args()
    own = None
    if args.index:
        from vlfit.index.store import EmbeddingIndex

        vectors = EmbeddingIndex(args.index).embeddings().numpy()
        own = np.sort(np.random.default_rng(args.seed).choice(len(vectors), min(QUERIES, len(vectors)), replace=False))
        queries = vectors[own]
        source = f"the index {args.index}"
    else:
        vectors, queries = synthetic(args.count, args.dim, args.seed)
        source = f"{args.count} synthetic clustered vectors of size {args.dim}"
    print(f"{source}; {len(queries)} queries; recall@10 against exact float32 search at the full size")
    rescores = tuple(int(n) for n in args.rescore.split(",")) if args.rescore else (None,)
    fractions = tuple(int(n) for n in args.fractions.split(","))
    rows = run(vectors, queries, own, rescores, fractions, tuple(args.storages.split(",")))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "source": source,
                    "command": rerun_command("smaller_vectors.py", args, ("json",)),
                    "machine": machine(),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
