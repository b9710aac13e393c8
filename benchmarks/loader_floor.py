"""Samples/s of the fast loader against the codec floor, side by side in one run, on photo-like JPEGs.

Measured on the same images, each a median of ``--rounds`` rounds that interleave the measurements, so that
background load hits them alike:

  floor      decode at the DCT scale the fast pipeline uses (simplejpeg), nothing else: the ceiling of any
             CPU pipeline that keeps that many pixels
  transform  the fast CPU transform alone (``FastImageTransform``: decode, crop, resize), image by image
  batches    the whole loader at ``--dataloader_num_workers 0``: record read, decode, crop/resize, tokenize,
             collate, through the loader ``vlfit train`` builds (accelerate's wrapping included)
  bench      what ``vlfit bench --mode loader --pipelines fast --workers 0`` measures: ``batches`` plus the
             device stage (normalize, on the CPU here), in its timed windows

The images are ``vlfit bench``'s default samples: synthetic photo-like scenes (textured, grain, 4:2:0), long side
600-1400 px, resized to the preset's input (294 px for ``large``). Torch runs on ``--threads`` threads (1: what a
loader worker gets), so the figures are per core.

    python benchmarks/loader_floor.py [--num_samples 96] [--model_preset large] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import simplejpeg
import torch

from vlfit.bench.plan import SweepPlan
from vlfit.bench.session import BenchSession
from vlfit.data.image_transforms import FastImageTransform
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.models.loading import resolve_model

MEASURES: tuple[str, ...] = ("floor", "transform", "batches", "bench")


def per_second(function: Callable[[], int]) -> float:
    """Samples per second of one call of ``function``, which returns the samples it made."""
    started = time.perf_counter()
    samples = function()
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_samples", type=int, default=96, help="distinct images, served cyclically")
    parser.add_argument("--model_preset", default="large")
    parser.add_argument("--batch_size", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6, help="timed batches per loader window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a loader worker's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    source = synthetic_source(args.num_samples, num_proc=2)
    spec = resolve_model(model_preset=args.model_preset, captions=source.captions)
    size = spec.inputs.image_size
    records = [source[i] for i in range(len(source))]
    transform = FastImageTransform(size)
    plan = SweepPlan(pipelines=["fast"], workers=[0], modes=["loader"], batch_size=args.batch_size,
                     steps=args.steps, warmup_steps=1, repeats=1, profile_batches=0)  # fmt: skip

    def floor() -> int:
        for record in records:
            simplejpeg.decode_jpeg(record.image, colorspace="RGB", min_height=size, min_width=size)
        return len(records)

    def transform_alone() -> int:
        for record in records:
            transform(record.image, record.id)
        return len(records)

    with tempfile.TemporaryDirectory(prefix="loader-floor-") as cache:
        session = BenchSession(source, spec.inputs, torch.device("cpu"), plan, cache_dir=cache,
                               source_key="loader-floor")  # fmt: skip

        def batches() -> int:
            served = 0
            for batch in session.loader("fast", 0, None):
                served += len(batch)
            return served

        timers: dict[str, Callable[[], float]] = {
            "floor": lambda: per_second(floor),
            "transform": lambda: per_second(transform_alone),
            "batches": lambda: per_second(batches),
            "bench": lambda: session.measure("loader", "fast", 0, None)["samples_per_second"],
        }
        for timer in timers.values():  # warm-up: codec tables, allocator, lazy imports, the tokenizer's caches
            timer()
        rounds: dict[str, list[float]] = {name: [] for name in MEASURES}
        for _ in range(args.rounds):
            for name in MEASURES:
                rounds[name].append(timers[name]())

    median = {name: statistics.median(values) for name, values in rounds.items()}
    kilobytes = sum(len(record.image) for record in records) / len(records) / 1024
    print(f"{len(records)} synthetic photo-like JPEGs, long side 600-1400 px ({kilobytes:.0f} KB each) -> "
          f"{size} px ({args.model_preset}), batch {args.batch_size}, {args.threads} torch thread(s), "
          f"median of {args.rounds} rounds")  # fmt: skip
    # Each round's ratio to that round's floor, then the median: what the interleaving keeps comparable.
    ratios = {
        name: statistics.median(value / floor for value, floor in zip(rounds[name], rounds["floor"], strict=True))
        for name in MEASURES
    }
    print(f"{'measure':<10} {'samples/s':>10} {'min':>8} {'max':>8} {'of floor':>9} {'ms/sample':>10}")
    for name in MEASURES:
        values = rounds[name]
        print(f"{name:<10} {median[name]:>10.1f} {min(values):>8.1f} {max(values):>8.1f} "
              f"{ratios[name]:>9.3f} {1000 / median[name]:>10.2f}")  # fmt: skip
    print("of floor: the median over rounds of each round's samples/s over that round's floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples_per_second": rounds, "median": median, "ratios": ratios, "size": size}, f, indent=1)


if __name__ == "__main__":
    main()
