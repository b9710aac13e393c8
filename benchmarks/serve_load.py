"""``vlfit serve`` under load, and the ANN structures it serves from, on this machine.

1. Index structures on synthetic embeddings (no images: the ANN part only, say so): N = 10^5 and 10^6 unit vectors
   of the demo model's embedding size, drawn around 1000 random centres (real embeddings cluster; uniform random
   vectors are the worst case of every quantizer), written as an index's shards. For each type (flat, HNSW, IVF-PQ;
   HNSW only at 10^5 unless --hnsw_at_1m), built and tuned by ``vlfit.index.ann_update.update_ann`` as
   ``vlfit retrieve index`` builds it, then opened as a query opens it (IVF-PQ memory-mapped, re-ranking its
   candidates from the memory-mapped shards): build time, bytes per vector of the structure, recall@10 against exact
   search on 1000 fresh queries from the same mixture (not drawn from the index), median latency of one query.
2. The server: a real ``vlfit serve`` process on a free loopback port, with the ``make demo`` model's INT8 text
   tower (``vlfit export --quantize int8``, ONNX Runtime) and a 10^5-vector index (HNSW), loaded by a bounded
   number of text queries at concurrency 1, 8 and 32, three times in turn: the medians of p50/p95/p99 latency and
   QPS over the three runs, and the server process's memory. QPS and latencies are of the answered (200) queries;
   queries refused with 503 (the server's admission) are counted apart and not sent again. What each stage of a
   query took on the server (decode, encode, search, rerank: ``vlfit_stage_seconds`` of ``/metrics``, read before
   and after each run), per level the medians over the runs of each stage's p50 and mean, and for the whole
   benchmark under ``server.stages``; a batched query counts its whole batch's time for each stage.
   The load comes from a minimal keep-alive HTTP/1.1 client on asyncio streams in this process (one connection per
   concurrent client, each from a loopback address of its own, so the server's per-client limits see distinct
   clients), which costs the shared cores far less than a full HTTP client library would.
3. Overload (open loop): text queries arriving at twice the capacity measured at concurrency 32 (or at
   ``--overload_qps``, to offer two servers the same load), at fixed times whatever the answers, for ``OVERLOAD_S``
   seconds, over a pool of keep-alive connections (``serve_pressure.open_loop``, its ``pooled`` mode; the pressure
   levels' ``overload`` runs it with fresh connections too); latency counted from each query's arrival time.
   Goal: p99 of the admitted (200) queries <= 10x the unloaded p50 (concurrency 1), the excess refused with 503 at
   once (``--max_queue_wait_ms``, ``--max_concurrency``) rather than queued.
4. Noisy neighbour: 8 clients sending text queries, quiet, then again while one more client sends, one after
   another, the largest queries the server admits: a text of ``--max_text_chars`` characters, a JPEG and a PNG of
   ``--max_query_pixels`` pixels. Goal: the 8 clients' p50 within 2x of the quiet run.
5. Pressure (``benchmarks/serve_pressure.py``, on the same model and index): 8 to 128 closed-loop clients that
   resend at once, open loop at twice their capacity on kept-open and on fresh connections, 9 and 40 addresses
   holding every connection slot, 32 and 64 slow request bodies, one address over the front's request rate, idle
   connections to an HTTPS server that never start their handshake, ``--workers 2`` from its ready line
   (``--pressure_levels`` picks among them). ``--pressure_only`` runs only this part;
   ``--server_src`` runs its servers from another checkout's ``src``, to hold two versions to the same load.

Every server flag is its default (``--num_threads 1``, ``--max_concurrency``, ...) but ``--model`` and
``--reload_interval 0``, and those given after ``--server_flags``.

The client runs on the same 2 cores as the server, so the QPS figures are a floor; ``--pin`` (Linux) puts the
server on the first core and the client on the others, so the client's work is not in the server's latencies.
Goals (issue: text query p50 <=
20 ms and >= 100 QPS at concurrency 8 on 10^5 vectors; IVF-PQ at 10^6 within 100 bytes/vector and recall@10 >=
0.90); clip-retrieval's published figures for its back end are about 50 ms and 20 QPS.

    python benchmarks/serve_load.py [--model runs/demo/model] [--out runs/serve-bench]
        [--results benchmarks/results/cpu-2core] [--server_only] [--overload_qps 400] [--pin]
        [--pressure_only [--server_src DIR]] [--server_flags --max_queue_wait_ms 20]

Needs ``make demo`` first. About 6 minutes on an idle 2-core CPU (the 10^6 IVF-PQ build is most of it;
``--server_only`` leaves the index structures out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time

import numpy as np
from pressure_clients import exchange, front
from serve_pressure import LEVELS as PRESSURE_LEVELS
from serve_pressure import OVERLOAD_S, on_server_cores, open_loop, serve_pressure

from vlfit.cli import main as vlfit
from vlfit.efficiency.cpu import cpu_info
from vlfit.inference.runtime_settings import RuntimeSettings

LEVELS = {1: 200, 8: 800, 32: 1600}  # concurrency -> requests sent at that level, per repeat
REPEATS = 3  # each level's figures are the medians over this many runs
QUERIES = 1000
NOISY_REQUESTS = 800  # text queries of the 8 normal clients, per run (quiet and noisy)


def _centres(rng: np.random.Generator, dim: int, count: int = 1000) -> np.ndarray:
    centres = rng.standard_normal((count, dim)).astype(np.float32)
    return centres / np.linalg.norm(centres, axis=1, keepdims=True)


def _mixture(rng: np.random.Generator, centres: np.ndarray, n: int, spread: float = 0.35) -> np.ndarray:
    picks = rng.integers(len(centres), size=n)
    x = centres[picks] + spread * rng.standard_normal((n, centres.shape[1])).astype(np.float32) / np.sqrt(
        centres.shape[1]
    )
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _synthetic_index(folder: str, identity, model: dict, vectors: np.ndarray) -> None:
    """An index of ``vectors`` (ids ``synthetic-{i}``) at ``folder``, as ``vlfit retrieve index`` lays one out."""
    import torch

    from vlfit.index.store import write_index_from_embeddings

    ids = [f"synthetic-{i}" for i in range(len(vectors))]
    write_index_from_embeddings(folder, identity, model, ids, torch.from_numpy(vectors),
                                collection={"synthetic_embeddings": len(vectors)})  # fmt: skip


def structures(out: str, identity, sizes: list[int], hnsw_at_1m: bool, seed: int = 0) -> list[dict]:
    import shutil

    import faiss

    from vlfit.index.ann import recall_at_k
    from vlfit.index.ann_update import open_ann, update_ann
    from vlfit.index.store import EmbeddingIndex

    dim = identity.embedding_size
    rng = np.random.default_rng(seed)
    centres = _centres(rng, dim)
    model = {"path": "synthetic", "backend": "none", "precision": "fp32"}
    rows = []
    for n in sizes:
        vectors = _mixture(rng, centres, n)
        queries = _mixture(rng, centres, QUERIES)
        exact = faiss.IndexFlatIP(dim)
        exact.add(vectors)
        _, truth = exact.search(queries, 10)
        folder = os.path.join(out, f"structures-{n}")
        shutil.rmtree(folder, ignore_errors=True)
        _synthetic_index(folder, identity, model, vectors)
        del exact, vectors
        types = ["flat", "hnsw", "ivfpq"] if n <= 100_000 or hnsw_at_1m else ["flat", "ivfpq"]
        for index_type in types:
            budget = 100 * n if index_type == "ivfpq" else None  # the goal's 100 bytes per vector
            started = time.perf_counter()
            update_ann(folder, index_type=index_type, max_index_memory=budget, target_recall=0.95, seed=seed)
            build_s = time.perf_counter() - started
            ann = open_ann(EmbeddingIndex(folder))
            _, found = ann.search(queries, 10)
            latencies = []
            for q in queries[:200]:
                t = time.perf_counter()
                ann.search(q[None], 10)
                latencies.append(time.perf_counter() - t)
            described = ann.describe()
            rows.append({"vectors": n, "type": index_type, "factory": described.get("factory"),
                         "search_params": described.get("search_params"), "rerank": described.get("rerank", 1),
                         "build_s": round(build_s, 1), "bytes_per_vector": described.get("bytes_per_vector"),
                         "recall_at_10_fresh_queries": round(recall_at_k(found, truth), 4),
                         "recall_at_10_tuning": described.get("recall_at_10"),
                         "query_ms_p50": round(1000 * float(np.median(latencies)), 3)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def write_index(folder: str, encoder, n: int, seed: int = 1) -> None:
    """A served index of ``n`` synthetic embeddings in ``encoder``'s space, with HNSW."""
    from vlfit.index.ann_update import update_ann

    rng = np.random.default_rng(seed)
    vectors = _mixture(rng, _centres(rng, encoder.identity.embedding_size), n)
    model = {"path": os.path.abspath(encoder.model_path), "backend": encoder.backend, "precision": encoder.precision}
    _synthetic_index(folder, encoder.identity, model, vectors)
    update_ann(folder, index_type="hnsw")


def _source(number: int) -> tuple[str, int]:
    """The loopback source address of client ``number``: each client an address of its own (Linux routes all of
    127/8 to lo), as clients on a network are, so the server's per-client limits see distinct clients."""
    return f"127.0.{2 + number // 250}.{1 + number % 250}", 0


async def _client(port: int, requests: list[bytes], latencies: list[float], number: int = 0) -> dict[int, int]:
    """Send ``requests`` one after another on one keep-alive connection (a refused one is not sent again) from
    client ``number``'s address; returns the count of each status. ``latencies`` gets the answered (200) requests'
    times."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=_source(number))
    statuses: dict[int, int] = {}
    try:
        for request in requests:
            started = time.perf_counter()
            status = (await exchange((reader, writer), request)).status
            if status == 200:
                latencies.append(time.perf_counter() - started)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()
    return statuses


def _upload_request(image: bytes, name: str) -> bytes:
    """A multipart image query (field ``file``, k 10)."""
    boundary = "vlfit-bench-boundary"
    fields = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"k\"\r\n\r\n10\r\n--{boundary}\r\n"
              f"Content-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
              "Content-Type: application/octet-stream\r\n\r\n")  # fmt: skip
    body = fields.encode() + image + f"\r\n--{boundary}--\r\n".encode()
    head = (f"POST /api/search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary={boundary}"
            f"\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


def _percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50_ms": None, "p99_ms": None}
    ms = 1000 * np.array(seconds)
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def _largest_queries(max_text_chars: int, max_pixels: int) -> list[tuple[str, bytes]]:
    """The largest queries the server admits: a text of ``max_text_chars``, a JPEG and a PNG of ``max_pixels``."""
    import io

    from PIL import Image

    width = int((max_pixels * 4 / 3) ** 0.5)
    height = max_pixels // width
    gradient = Image.linear_gradient("L").resize((width, height))
    picture = Image.merge("RGB", (gradient, gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT), gradient))
    encoded = {}
    for name, kwargs in (("jpeg", {"quality": 90}), ("png", {"compress_level": 1})):
        out = io.BytesIO()
        picture.save(out, format=name.upper(), **kwargs)
        encoded[name] = out.getvalue()
    text = ("two red circles on the left of a blue square " * (max_text_chars // 45 + 1))[:max_text_chars]
    return [("text", front.search_request(text, k=10)), ("jpeg", _upload_request(encoded["jpeg"], "max.jpg")),
            ("png", _upload_request(encoded["png"], "max.png"))]  # fmt: skip


async def _noisy_neighbour(port: int, texts: list[str], largest: list[tuple[str, bytes]]) -> dict:
    """8 clients' text queries, quiet and then beside one client sending the largest queries in turn."""
    quiet = await _load(port, texts, 8, NOISY_REQUESTS)
    stop = asyncio.Event()
    sent: dict[str, list] = {name: [] for name, _ in largest}

    async def neighbour() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=_source(999))
        turn = 0
        while not stop.is_set():
            name, request = largest[turn % len(largest)]
            started = time.perf_counter()
            status = (await exchange((reader, writer), request)).status
            sent[name].append((status, time.perf_counter() - started))
            turn += 1
        writer.close()

    task = asyncio.get_running_loop().create_task(neighbour())
    await asyncio.sleep(1.0)  # the neighbour is under way
    noisy = await _load(port, texts, 8, NOISY_REQUESTS)
    stop.set()
    await task
    neighbour_figures = {name: {"sent": len(runs), "statuses": sorted({status for status, _ in runs}),
                                "p50_ms": _percentiles([s for _, s in runs])["p50_ms"]}
                         for name, runs in sent.items()}  # fmt: skip
    return {"quiet": quiet, "noisy": noisy, "p50_ratio": round(noisy["p50_ms"] / quiet["p50_ms"], 2),
            "neighbour": neighbour_figures}  # fmt: skip


async def _load(port: int, texts: list[str], concurrency: int, count: int) -> dict:
    requests = [front.search_request(texts[i % len(texts)], k=10) for i in range(count)]
    await _client(port, requests[:1], [])  # warm the model
    latencies: list[float] = []
    started = time.perf_counter()
    per_client = [requests[i::concurrency] for i in range(concurrency)]
    statuses: dict[int, int] = {}
    for counted in await asyncio.gather(*(_client(port, part, latencies, i) for i, part in enumerate(per_client))):
        for status, number in counted.items():
            statuses[status] = statuses.get(status, 0) + number
    wall = time.perf_counter() - started
    ms = 1000 * np.array(latencies or [float("nan")])
    refused, answered = statuses.get(503, 0), statuses.get(200, 0)
    return {"concurrency": concurrency, "requests": count, "errors": count - answered - refused,
            "refused_503": refused, "qps": round(answered / wall, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p95_ms": round(float(np.percentile(ms, 95)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2)}  # fmt: skip


def _median_run(measured: list[dict]) -> dict:
    """The median of each figure over the repeats of one level, with every run kept under ``runs``."""
    keys = ("qps", "p50_ms", "p95_ms", "p99_ms")
    median: dict[str, object] = {key: round(float(np.median([run[key] for run in measured])), 2) for key in keys}
    median["stages"] = {stage: {key: round(float(np.median([run["stages"][stage][key] for run in measured
                                                               if stage in run["stages"]])), 3)
                                for key in ("p50_ms", "mean_ms")}
                        for stage in measured[0]["stages"]}  # fmt: skip
    errors = sum(run["errors"] for run in measured)
    refused = sum(run["refused_503"] for run in measured)
    return {**measured[0], **median, "errors": errors, "refused_503": refused, "repeats": len(measured),
            "runs": measured}  # fmt: skip


def serve_load(index: str, model: str, log_path: str, server_flags: list[str] | None = None,
               overload_qps: float | None = None, pin: bool = False) -> dict:  # fmt: skip
    import httpx
    import psutil

    from vlfit.data.synthetic.scenes import scene_and_choices
    from vlfit.serve.launch import start_server
    from vlfit.serve.metrics import stage_figures

    rng = np.random.default_rng(2)
    texts = [text for _ in range(100) for text in scene_and_choices(rng)[1]]
    flags = ["--index", index, "--model", model, "--reload_interval", "0", *(server_flags or [])]
    with on_server_cores(pin):  # the server's process and threads on the first core (inherited), the client apart
        server = start_server(flags, log_path, timeout=180)
    base, port = server.url, server.port
    try:
        health = httpx.get(f"{base}/api/health", timeout=10).json()
        runs: dict[int, list[dict]] = {concurrency: [] for concurrency in LEVELS}
        for _ in range(REPEATS):  # the levels in turn, REPEATS times: drifts of the shared machine hit each alike
            for concurrency, count in LEVELS.items():
                before = httpx.get(f"{base}/metrics", timeout=10).text
                run = asyncio.run(_load(port, texts, concurrency, count))
                run["stages"] = stage_figures(httpx.get(f"{base}/metrics", timeout=10).text, since=before)
                runs[concurrency].append(run)
                print(json.dumps(runs[concurrency][-1]), flush=True)
        levels = [_median_run(measured) for measured in runs.values()]
        capacity = levels[-1]["qps"]  # closed loop at concurrency 32
        requests = [front.search_request(text, k=10) for text in texts]
        overload = asyncio.run(open_loop(base, requests, overload_qps or 2 * capacity, OVERLOAD_S))
        overload.update(capacity_qps=capacity, of_capacity=round(overload["offered_qps"] / capacity, 2))
        overload["unloaded_p50_ms"] = levels[0]["p50_ms"]
        overload["p99_over_unloaded_p50"] = round((overload["admitted_p99_ms"] or 0) / levels[0]["p50_ms"], 2)
        print(json.dumps({"overload": overload}), flush=True)
        from vlfit.serve.limits import ServerLimits

        largest = _largest_queries(ServerLimits.max_text_chars, ServerLimits.max_query_pixels)
        noisy = asyncio.run(_noisy_neighbour(port, texts, largest))
        print(json.dumps({"noisy_neighbour": noisy}), flush=True)
        stages = stage_figures(httpx.get(f"{base}/metrics", timeout=10).text)
        print(json.dumps({"stages": stages}), flush=True)
        memory_mb = psutil.Process(server.process.pid).memory_info().rss / 2**20
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
    return {"health": health, "levels": levels, "overload": overload, "noisy_neighbour": noisy, "stages": stages,
            "server_rss_mb": round(memory_mb, 1), "exit_code": server.process.returncode}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/demo/model")
    parser.add_argument("--data", default="runs/demo/data", help="Calibration data of the INT8 export.")
    parser.add_argument("--out", default="runs/serve-bench")
    parser.add_argument("--results", default=None, help="Also write serve_load.json here.")
    parser.add_argument("--hnsw_at_1m", action="store_true", help="Also build HNSW on 10^6 vectors (minutes).")
    parser.add_argument("--server_only", action="store_true", help="Leave the index structures (1.) out.")
    parser.add_argument(
        "--overload_qps",
        type=float,
        default=None,
        help="Arrivals per second of the overload level (default: 2x the concurrency-32 capacity).",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="Run the server on the first core and this load client on the others (Linux), so the client's work "
        "is not in the server's latencies.",
    )
    parser.add_argument("--pressure_only", action="store_true", help="Run only the pressure levels (5.).")
    parser.add_argument("--server_src", default=None, help="Pressure levels: the server from this src (PYTHONPATH).")
    parser.add_argument("--pressure_levels", nargs="*", choices=PRESSURE_LEVELS, default=list(PRESSURE_LEVELS),
                        help="Pressure levels (5.); none: none.")  # fmt: skip
    parser.add_argument(
        "--server_flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="Flags of vlfit serve (last: everything after it is passed on).",
    )
    args = parser.parse_args()
    if not os.path.isdir(args.model):
        sys.exit(f"{args.model}: no model; run make demo first")
    exported = os.path.join(args.out, "int8")
    if not os.path.isfile(os.path.join(exported, "export_manifest.json")):
        code = vlfit(["export", "--model_name_or_path", args.model, "--output_dir", exported, "--quantize", "int8",
                      "--calibration_dataset", args.data])  # fmt: skip
        if code:
            sys.exit(f"vlfit export exited {code}")
    from vlfit.inference.runtime import ModelRuntime

    encoder = ModelRuntime.open(exported, RuntimeSettings(backend="auto", precision="int8")).encoder
    dim = encoder.identity.embedding_size
    index = os.path.join(args.out, "index-100k")
    if not os.path.isfile(os.path.join(index, "index_manifest.json")):
        write_index(index, encoder, 100_000)
    served, built = {}, []
    if not args.pressure_only:
        cores = os.sched_getaffinity(0)
        served = serve_load(index, exported, os.path.join(args.out, "server.log"), args.server_flags,
                            args.overload_qps, args.pin)  # fmt: skip
        os.sched_setaffinity(0, cores)  # --pin's split ends with its levels: part 5 starts its own servers
    pressure = None
    if args.pressure_levels:
        pressure = serve_pressure(index, exported, args.out, args.server_flags, args.server_src,
                                  tuple(args.pressure_levels))  # fmt: skip
    if not (args.pressure_only or args.server_only):
        built = structures(args.out, encoder.identity, [100_000, 1_000_000], args.hnsw_at_1m)
    machine = {**cpu_info().record(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version()}  # fmt: skip
    results = {"machine": machine, "load_average": os.getloadavg(), "embedding_dim": dim,
               "text_tower": encoder.description, "server_flags": args.server_flags, "pinned": args.pin,
               "server": served, "pressure": pressure,
               "structures": built}  # fmt: skip
    name = "serve_pressure.json" if args.pressure_only else "serve_load.json"
    for folder in filter(None, (args.out, args.results)):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
