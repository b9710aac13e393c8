"""The fast input pipeline on the same WebDataset shards read four ways, at dataloader_num_workers 0, 1 and 2.

- ``local map``: ``TarSource``, the map-style source ``vlfit train`` reads tar shards with today (members read in
  place by offset, shuffled by a sampler);
- ``local stream``: ``vlfit.data.stream.ShardStream`` over the shard files (read front to back, shuffle buffer);
- ``http stream``: the same stream over loopback HTTP, from a server process of its own (``tests/http_shards.py``'s
  ``ShardServer``: python's threading HTTP server with Range requests, as fsspec reads);
- ``local resampled mix``: the shards as two weighted sources (1:3) read locally, shards drawn with replacement;
- ``http resampled mix``: the same two sources over HTTP.

Every stream reads shards all through the measured batches: there are enough shards that no reader's share runs
out before the measurement ends (a reader whose share fits in its shuffle buffer would read nothing while it is
timed and measure decoding alone).

Each is decoded and resized by the fast pipeline (``InputPipeline``: DCT-scaled JPEG decode and uint8 resize in
the workers, batches of 48 at 224 px, one torch thread per worker) and measured in samples/s over a fixed number
of batches after the first, three times in turn; medians are reported. Images are ``vlfit make-data`` scenes of
400-700 px (JPEG quality 90, about 40 KB). Goal (issue): streaming within 10% of local reads at the best worker
count.

    python benchmarks/streaming.py [--out runs/streaming-bench] [--results benchmarks/results/cpu-2core]

About 4 minutes on an idle 2-core CPU. Loopback has no latency and no bandwidth limit: what an object store adds
(round trips per range request, throughput per connection) is not measured here.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import platform
import sys
import tarfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.http_shards

SHARDS, PER_SHARD = 32, 256
BATCH, BATCHES, REPEATS = 48, 30, 3
WORKERS = (0, 1, 2)
SHUFFLE_BUFFER, PREFETCH = 1000, 4


def check_streams_keep_reading() -> None:
    """Each reader's share of the shards outlasts its buffer plus every batch it makes while measured."""
    for workers in WORKERS:
        roles = max(1, workers)
        needed = SHUFFLE_BUFFER + (BATCHES + 1 + PREFETCH * workers) * BATCH // roles
        share = SHARDS // roles * PER_SHARD
        if share <= needed:
            raise SystemExit(f"{workers} workers: a reader's {share} samples would run out (it reads {needed})")


def write_shards(folder: str) -> list[str]:
    """``SHARDS`` tar shards of synthetic scenes (``.jpg`` and ``.txt`` per sample), made once."""
    from vlfit.data.synthetic.dataset import make_record
    from vlfit.data.synthetic.scenes import SyntheticConfig

    paths = [os.path.join(folder, f"{i:03d}.tar") for i in range(SHARDS)]
    if all(os.path.isfile(p) for p in paths):
        return paths
    os.makedirs(folder, exist_ok=True)
    config = SyntheticConfig(num_samples=SHARDS * PER_SHARD, seed=0, min_long_side=400, max_long_side=700)
    for number, path in enumerate(paths):
        with tarfile.open(path + ".tmp", mode="w") as archive:
            for i in range(number * PER_SHARD, (number + 1) * PER_SHARD):
                record = make_record(i, config)
                for ext, data in (("jpg", record["image"]["bytes"]), ("txt", record["image_description"].encode())):
                    info = tarfile.TarInfo(f"{record['instance_id']}.{ext}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        os.replace(path + ".tmp", path)
    return paths


def _serve(paths: list[str], ready: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    from tests.http_shards import ShardServer

    files = {}
    for path in paths:
        with open(path, "rb") as f:
            files[f"/shards/{os.path.basename(path)}"] = f.read()
    with ShardServer(files) as server:
        ready.put(server.url("/shards/"))
        stop.wait(3600)


def _pipeline():
    from vlfit.data.pipeline import InputPipeline, PipelineOptions
    from vlfit.data.synthetic.scenes import SyntheticConfig, caption, scene_and_choices
    from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, InputSpec
    from vlfit.models.tokenizer import train_caption_tokenizer

    rng = np.random.default_rng(0)
    grammar = SyntheticConfig().caption_grammar
    captions = [caption(scene_and_choices(rng)[0], grammar) for _ in range(500)]
    spec = InputSpec(224, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, train_caption_tokenizer(captions, 512), 32)
    return InputPipeline(spec, PipelineOptions(image_pipeline="fast"), torch.device("cpu"))


def _dataset(pipeline, mode: str, paths: list[str], base_url: str, seed: int):
    from vlfit.data.sources.tar import TarSource
    from vlfit.data.stream import ShardReader, ShardStream, parse_sources

    if mode == "local map":
        return pipeline.dataset(TarSource(paths, name="shards"), train=True)
    every, half = f"{{000..{SHARDS - 1:03d}}}.tar", SHARDS // 2
    if mode == "local stream":
        sources, resampled = parse_sources(os.path.join(os.path.dirname(paths[0]), every)), False
    elif mode == "http stream":
        sources, resampled = parse_sources(base_url + every), False
    else:  # two sources, 1:3
        base = base_url if mode.startswith("http") else os.path.dirname(paths[0]) + "/"
        spec = f"{base}{{000..{half - 1:03d}}}.tar::{base}{{{half:03d}..{SHARDS - 1:03d}}}.tar"
        sources, resampled = parse_sources(spec, [1, 3]), True
    reader = ShardReader(timeout=30)
    stream = ShardStream(sources, reader=reader, shuffle_buffer=SHUFFLE_BUFFER, seed=seed, resampled=resampled)
    return pipeline.stream_dataset(stream, train=True)


def measure(pipeline, mode: str, workers: int, paths: list[str], base_url: str, seed: int) -> float:
    """Samples/s over ``BATCHES`` batches after the first (which includes starting the workers)."""
    from vlfit.data.pipeline import LoaderSettings

    dataset = _dataset(pipeline, mode, paths, base_url, seed)
    settings = LoaderSettings(num_workers=workers, prefetch_factor=PREFETCH if workers else None)
    shuffle = mode == "local map"
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    loader = pipeline.loader(dataset, batch_size=BATCH, settings=settings, shuffle=shuffle, generator=generator)
    batches = iter(loader)
    next(batches)
    started, samples = time.perf_counter(), 0
    for _ in range(BATCHES):
        samples += len(next(batches))
    elapsed = time.perf_counter() - started
    del batches
    return samples / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/streaming-bench")
    parser.add_argument("--results", default=None, help="Also write streaming.json here.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    check_streams_keep_reading()
    paths = write_shards(os.path.join(args.out, "shards"))
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    server = context.Process(target=_serve, args=(paths, ready, stop), daemon=True)
    server.start()
    base_url = ready.get(timeout=120)
    pipeline = _pipeline()
    modes = ("local map", "local stream", "http stream", "local resampled mix", "http resampled mix")
    runs: dict[str, dict[int, list[float]]] = {m: {w: [] for w in WORKERS} for m in modes}
    try:
        for repeat in range(REPEATS):  # every configuration once per repeat: drifts hit each alike
            for workers in WORKERS:
                for mode in modes:
                    rate = measure(pipeline, mode, workers, paths, base_url, seed=repeat)
                    runs[mode][workers].append(round(rate, 1))
                    print(json.dumps({"mode": mode, "workers": workers, "repeat": repeat, "samples_s": rate}),
                          flush=True)  # fmt: skip
    finally:
        stop.set()
        server.join(10)
    table = {
        mode: {str(w): float(np.median(rates)) for w, rates in by_workers.items()} for mode, by_workers in runs.items()
    }
    best_local = max(max(table["local map"].values()), max(table["local stream"].values()))
    results = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "setup": {
            "shards": SHARDS,
            "samples_per_shard": PER_SHARD,
            "batch_size": BATCH,
            "batches": BATCHES,
            "repeats": REPEATS,
            "image_size": 224,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "prefetch_factor": PREFETCH,
        },  # fmt: skip
        "median_samples_per_s": table,
        "runs": runs,
        "http_stream_vs_best_local": round(max(table["http stream"].values()) / best_local, 3),
        "http_mix_vs_best_local": round(max(table["http resampled mix"].values()) / best_local, 3),
        "http_mix_vs_local_mix": round(
            max(table["http resampled mix"].values()) / max(table["local resampled mix"].values()), 3
        ),
    }
    for folder in filter(None, (args.out, args.results)):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "streaming.json"), "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
