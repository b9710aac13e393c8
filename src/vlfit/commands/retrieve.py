"""``vlfit retrieve index`` (embed a collection of images into an index, then bring its ANN structure up to date),
``vlfit retrieve query`` (top-k images of text or image queries: through the ANN structure, or ``--exact``; of an
index folder or of a vector database it was pushed to), ``vlfit retrieve push`` (write an index to a vector database:
LanceDB, Qdrant, Chroma, PostgreSQL with pgvector, Milvus) and ``vlfit retrieve verify`` (check an index's files
against its manifest: one line per problem, exit 2 unless whole).

The ANN structure needs the ``serve`` extra (faiss); ``vlfit retrieve index`` checks for it before embedding
anything."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

from vlfit.arguments.runtime import RUNTIME_FLAGS, runtime_arguments
from vlfit.cli import SUBCOMMANDS as COMMAND_SUBCOMMANDS
from vlfit.commands.parsing import CommandParser
from vlfit.commands.retrieve_queries import Query, check_queries, embed_queries, read_queries
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.index.ann_choice import DEFAULT_MAX_INDEX_MEMORY, DEFAULT_TARGET_RECALL, STORAGE_RESCORE, rescore_factors
from vlfit.index.job import IndexJob, index_collection
from vlfit.index.push.base import is_target_uri
from vlfit.index.push.pushed import PushedIndex
from vlfit.index.rerank import Reranker, check_rerank_top_k, rerankable_items
from vlfit.index.search import query_runtime, search
from vlfit.index.stages import StageTimes
from vlfit.index.verify import open_index, verify_index
from vlfit.inference.rerank_score import RERANK_SCORES, check_rerank_weight
from vlfit.inference.topk import DEFAULT_CHUNK_ELEMENTS

SUBCOMMANDS = COMMAND_SUBCOMMANDS["retrieve"]
# Flags of vlfit retrieve index that are not the job's own fields (the runtime's travel as one value).
CLI_ONLY = ("dataloader_num_workers", "disable_tqdm", "json", *RUNTIME_FLAGS)
Verify = Literal["quick", "full"]
IndexType = Literal["auto", "flat", "hnsw", "ivfpq"]
VectorStorage = Literal["float32", "int8", "binary"]


@dataclass
class IndexArguments(runtime_arguments()):
    """Flags of ``vlfit retrieve index``."""

    model: str = flag(help="A checkpoint folder, or a folder vlfit export wrote.")
    output_dir: str = flag(help="The index folder (created; an existing index is resumed/appended).")
    images: str | None = flag(None, "A folder of image files (searched recursively).")
    dataset_name: str | None = flag(
        None,
        "Or a dataset to embed a split of: a hub id, a folder, data files or tar shards (as vlfit train); "
        "tar shards at URLs (https://, s3://...) are fetched one at a time beside the index, embedded, deleted.",
    )
    split: str = flag("test", "Split of --dataset_name.")
    image_column: str = flag("image", "Image column of --dataset_name.")
    caption_column: str = flag("image_description", "Caption column of --dataset_name.")
    image_id_column: str | None = flag(
        None,
        "Column of --dataset_name naming the image a row shows: rows of one image are one item, with all "
        "their captions (as vlfit eval groups them). Default: rows with identical image bytes are one image; a "
        "list caption column's row is one image.",
    )
    batch_size: int = flag(32, "Images per forward pass.")
    dataloader_num_workers: int = flag(
        default_factory=lambda: min(4, os.cpu_count() or 1),
        help="Loader workers decoding and resizing (the default is min(4, CPU count)).",
    )
    shard_size: int | None = flag(
        None, "Images per shard (what an interrupted build redoes). Default: what the index was built with, else 4096."
    )
    storage: Literal["safetensors", "npy"] = flag("safetensors", "Shard file format.")
    disable_tqdm: bool = flag(False, "No progress bar.")
    json: bool = flag(False, "Print the summary as JSON instead of lines of text.")
    index_type: IndexType | None = flag(
        None,
        "ANN structure: auto (flat below 100k items, HNSW while it fits --max_index_memory, else IVF-PQ), "
        "flat (exact), hnsw or ivfpq. Default: what the index was built with, else auto.",
    )
    max_index_memory: int | None = flag(
        None,
        "Bytes the ANN structure may take. Default: what the index was built with, else "
        f"{DEFAULT_MAX_INDEX_MEMORY} (4 GiB).",
    )
    target_recall: float | None = flag(
        None,
        "Recall@10 against exact search that the ANN search parameter is tuned to reach. Default: "
        f"what the index was built with, else {DEFAULT_TARGET_RECALL}.",
    )
    vector_storage: VectorStorage | None = flag(
        None,
        "What queries scan: float32 (the --index_type structure), int8 (faiss's 8-bit scalar "
        "quantizer, each dimension's range trained: 4x smaller) or binary (sign bits by Hamming distance: "
        "32x smaller); int8 and binary scan every code and re-score the top --rescore x k candidates with "
        "the float32 vectors the shards keep. Default: what the index was built with, else float32.",
    )
    rescore: int | None = flag(
        None,
        "--vector_storage int8 or binary: candidates re-scored exactly per result wanted. Default: "
        "what the index was built with, else tuned: the smallest of "
        + " and ".join(f"{', '.join(map(str, rescore_factors(s)))} for {s}" for s in STORAGE_RESCORE)
        + " whose recall@10 reaches --target_recall.",
    )
    shard_retries: int = flag(
        3,
        "Tar shards at URLs: times a failing shard is fetched again (with backoff) before it is "
        "left out, listed as bad, and tried again by the next run.",
    )
    shard_timeout: float = flag(60.0, "Tar shards at URLs: seconds a connection or one read may take.")
    storage_options: str | None = flag(
        None, "Tar shards at URLs: fsspec storage options, a JSON object (headers, auth, client_kwargs...)."
    )
    shard_block_size: int | None = flag(
        None,
        "Tar shards at URLs: bytes per HTTP Range request; 0: one whole-file GET per shard (servers "
        "that ignore Range requests, otherwise detected on the first such answer).",
    )
    ddp_timeout: int = flag(
        1800, "Under torchrun: seconds the processes wait for each other (to start, and per shard)."
    )
    distributor: Literal["torch", "ray"] = flag(
        "torch",
        "Who embeds and writes the shards: torch (this process, or each process torchrun started "
        "its share) or ray (Ray actors, one per CPU slot of the cluster, a lost one retried; this process "
        "lists their shards and builds the ANN structure; the ray extra).",
    )
    ray_address: str | None = flag(
        None,
        "--distributor ray: the Ray cluster to join (auto: the one ray start started here; "
        "ray://HOST:10001: Ray Client). Default: RAY_ADDRESS when set, else a local cluster for the build.",
    )
    verify: Verify = flag(
        "quick",
        "How an existing index is checked before appending: quick (sizes) or full (checksums, "
        "finite embeddings); the items of a damaged shard are embedded again, a damaged ANN file rebuilt.",
    )

    def job(self) -> IndexJob:
        """The indexing these flags ask for (every value checked before anything is opened)."""
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in CLI_ONLY}
        return IndexJob(**same, runtime=self.settings(), num_workers=self.dataloader_num_workers,
                        progress=not self.disable_tqdm)  # fmt: skip


@dataclass
class QueryArguments(runtime_arguments()):
    """Flags of ``vlfit retrieve query``."""

    index: str = flag(
        help="The index folder (vlfit retrieve index's output), or a vector database it was pushed to "
        "(lancedb:PATH, qdrant:PATH, chroma:PATH, postgresql://..., milvus:PATH.db; each [#collection])."
    )
    verify: Verify = flag(
        "quick",
        "How the index is checked before it is searched: quick (each file there with its recorded "
        "size) or full (checksums and finite embeddings too: reads the whole index).",
    )
    text: list[str] = flag(
        default_factory=list, help="Text queries (repeat the flag or list several: --text a --text b)."
    )
    image: list[str] = flag(default_factory=list, help="Image files to find similar images of.")
    queries: str | None = flag(
        None, "A file of queries, one per line: text, or image:PATH (PATH as typed: relative to here)."
    )
    k: int = flag(10, "Results per query.", aliases=["-k"])
    json: bool = flag(False, "Print the results as JSON.")
    timing: bool = flag(
        False,
        "Report what each stage took, in milliseconds: open (the index and model), decode (image "
        "queries), encode, search, rerank (with --rerank_top_k) and total; a timing object with --json, "
        "else one line per stage after the results.",
    )
    model: str | None = flag(None, "The model to embed queries with (default: the one the index was built with).")
    chunk_elements: int = flag(DEFAULT_CHUNK_ELEMENTS, "Largest number of similarity scores held at once.")
    exact: bool = flag(False, "Scan every embedding of the shards instead of using the ANN structure.")
    rerank_top_k: int | None = flag(
        None,
        "Re-rank each text query's top K candidates by the model's image-text matching head "
        "(BridgeTower trained with --objective contrastive+itm, or its export), then keep -k of them.",
    )
    rerank_score: str | None = flag(
        None,
        "What re-ranked candidates are ordered by: itm (the matching log-odds) or itm+itc (plus "
        "--rerank_weight times the cosine). Default: itm+itc when the model's run saved a weight "
        "(rerank.json), else itm.",
        choices=RERANK_SCORES,
    )
    rerank_weight: float | None = flag(
        None, "The cosine's weight in --rerank_score itm+itc (default: the one the model's run saved)."
    )


@dataclass
class PushArguments:
    """Flags of ``vlfit retrieve push``."""

    index: str = flag(help="The index folder (vlfit retrieve index's output).")
    to: str = flag(
        help="The vector database: lancedb:PATH, qdrant:PATH (or qdrant::memory:, "
        "qdrant:http://HOST:6333), chroma:PATH (or chroma:http://HOST:8000), postgresql://USER@HOST/DB "
        "(pgvector), milvus:PATH.db (or milvus:http://HOST:19530); #NAME at the end names the collection "
        "or table (default: vlfit)."
    )
    overwrite: bool = flag(False, "Write every item again, also those the collection holds already.")
    delete_missing: bool = flag(False, "Remove the items of the collection that the index does not hold.")
    batch_size: int | None = flag(
        None,
        "Items per write. Default: the engine's bulk size: LanceDB 20000, PostgreSQL "
        "10000, Chroma and Milvus 5000, Qdrant 1000.",
    )
    verify: Verify = flag("quick", "How the index is checked before it is pushed: quick or full.")
    disable_tqdm: bool = flag(False, "No progress bar.")
    json: bool = flag(False, "Print the summary as JSON.")


@dataclass
class VerifyArguments:
    """Flags of ``vlfit retrieve verify``."""

    index: str = flag(help="The index folder (vlfit retrieve index's output).")
    verify: Verify = flag(
        "quick",
        "quick: the manifest parses and each file is there with its recorded size; full: checksums, "
        "ids and captions that parse, finite embeddings too (reads the whole index).",
    )
    json: bool = flag(False, "Print the report as JSON.")


# Each subcommand's flags, the description its --help opens with, and the flags that may be repeated.
PARSERS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "index": (
        IndexArguments,
        "Embed a folder of images or a dataset split into an index (resumable; new images are appended when run "
        "again). Bad images are skipped and listed.",
        (),
    ),
    "query": (
        QueryArguments,
        "The top-k images of an index for text queries, image queries or a file of them.",
        ("text", "image"),
    ),
    "push": (
        PushArguments,
        "Push an index to a vector database: its items' ids, embeddings, captions and paths, in batches; items "
        "already there are skipped, so a stopped push resumes when run again. The collection records the model; "
        "vlfit retrieve query --index URI searches it with that model.",
        (),
    ),
    "verify": (
        VerifyArguments,
        "Check an index's files against its manifest: one line per damaged file, naming the command that rebuilds "
        "it; exit 0 when the index is whole, 2 otherwise.",
        (),
    ),
}


def run_index(args: IndexArguments) -> int:
    """``vlfit retrieve index``: embed the collection, bring the ANN structure up to date, report (rank 0); exit 2
    when every item was left out, or tar shards at URLs could not be indexed (listed in the manifest; the same
    command tries them again)."""
    report = index_collection(args.job())
    if report.lead:
        print(json.dumps(report.to_dict(), indent=1) if args.json else "\n".join(report.lines()))
    report.raise_for_failures()
    return 0


def run_query(args: QueryArguments) -> int:
    """``vlfit retrieve query``: embed the queries with the index's model, search, print the hits (``--timing``: and
    what each stage took)."""
    started = time.perf_counter()
    queries = [Query(text=text) for text in args.text] + [Query(image=image) for image in args.image]
    if args.queries:
        queries += read_queries(args.queries)
    if not queries:
        raise ConfigError("no query given: pass --text, --image or --queries FILE")
    if args.k < 1:
        raise ConfigError(f"-k must be at least 1, got {args.k}")
    top_k = args.rerank_top_k
    check_rerank_top_k(top_k)
    check_rerank_weight(args.rerank_weight)
    if top_k is None and (args.rerank_score is not None or args.rerank_weight is not None):
        raise ConfigError("--rerank_score and --rerank_weight say how re-ranked candidates are ordered: add "
                          "--rerank_top_k K, or drop them")  # fmt: skip
    if top_k is not None and any(q.image is not None for q in queries):
        raise ConfigError("--rerank_top_k re-ranks text queries (the matching head scores a caption against an "
                          "image): search image queries without it")  # fmt: skip
    pushed = is_target_uri(args.index)
    if pushed and top_k is not None:
        raise ConfigError(f"--rerank_top_k reads the candidates' images, which {args.index} does not hold: re-rank "
                          "against the index folder it was pushed from")  # fmt: skip
    check_queries(queries)  # before the index and the model open
    times = StageTimes()
    with times.stage("open"):
        index = PushedIndex(args.index) if pushed else open_index(args.index, args.verify)
        items = rerankable_items(index) if top_k is not None else None  # refused before the model opens
        runtime = query_runtime(index, args.model, args.settings())
        if items is not None:
            runtime.require_pair_scorer()  # refused before any query runs
            by = runtime.rerank_score(args.rerank_score, args.rerank_weight)
    embeddings = embed_queries(runtime, queries, times=times)
    wanted = max(args.k, top_k or 0)
    with times.stage("search"):
        if isinstance(index, PushedIndex):
            results = index.search(embeddings, wanted, exact=args.exact)
        else:
            results = search(index, embeddings, wanted, chunk_elements=args.chunk_elements, exact=args.exact)
    if items is not None:
        with times.stage("rerank"):
            reranker = Reranker.beside(runtime, index, items)
            results = reranker.rerank(results, [q.text or "" for q in queries], top_k, args.k, by)
    timing = {**times.milliseconds(), "total": round(1000 * (time.perf_counter() - started), 3)}
    if args.json:
        out = [
            {"query": q.description, "results": [hit.to_json() for hit in hits]}
            for q, hits in zip(queries, results, strict=True)
        ]
        report: dict[str, object] = {"model": runtime.encoder.description, "queries": out}
        print(json.dumps({**report, "timing": timing} if args.timing else report, indent=1))
    else:
        for q, hits in zip(queries, results, strict=True):
            print(q.description)
            for rank, hit in enumerate(hits, start=1):
                match = f"  match {hit.match_score:+.4f}" if hit.match_score is not None else ""
                match += f"  fused {hit.fused_score:+.4f}" if hit.fused_score is not None else ""
                print(f"  {rank:>3}  {hit.score:.4f}{match}  {hit.id}")
                for caption in hit.captions or ():
                    print(f"{'':>15}{caption}")
        if args.timing:
            for stage, ms in timing.items():
                print(f"{stage:<7} {ms:>10.3f} ms")
    return 0


def run_push(args: PushArguments) -> int:
    """``vlfit retrieve push``: push the index to the vector database, report what was written."""
    from vlfit.index.push.job import push_index

    index = open_index(args.index, args.verify)
    report = push_index(index, args.to, overwrite=args.overwrite, delete_missing=args.delete_missing,
                        batch_size=args.batch_size, progress=not args.disable_tqdm)  # fmt: skip
    print(json.dumps(report.to_dict(), indent=1) if args.json else "\n".join(report.lines()))
    return 0


def run_verify(args: VerifyArguments) -> int:
    """``vlfit retrieve verify``: the checks ``vlfit serve`` and ``vlfit retrieve query`` run as they open the index,
    reported in full; 0 when the index is whole, 2 otherwise."""
    check = verify_index(args.index, args.verify)
    if args.json:
        print(json.dumps(check.to_dict(), indent=1))
    else:
        print("\n".join(check.lines()))
    return 0 if check.whole else 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit retrieve index|query|push|verify`` (``argv`` None reads ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        given = repr(argv[0]) if argv else "nothing"
        if argv and argv[0] in ("-h", "--help"):
            print("usage: vlfit retrieve index|query|push|verify [flags]   (vlfit retrieve push --help: its flags)")
            return 0
        raise ConfigError(f"vlfit retrieve takes a subcommand, index, query, push or verify; got {given}")
    flags, description, repeatable = PARSERS[argv[0]]
    parser = CommandParser(flags, prog=f"vlfit retrieve {argv[0]}", description=description, repeatable=repeatable)
    (args,) = parser.parse_args_into_dataclasses(args=argv[1:])
    if isinstance(args, VerifyArguments):
        return run_verify(args)
    if isinstance(args, PushArguments):
        return run_push(args)
    return run_index(args) if isinstance(args, IndexArguments) else run_query(args)
