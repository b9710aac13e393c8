"""Images/s per core of each CPU image pipeline, side by side on the same New-Yorker-like JPEGs.

Pipelines (all produce a model-ready 294x294 image, the large preset's input):
  reference  Pillow decode -> float -> bicubic resize -> center crop -> normalize (run_bridgetower.py)
  fast       DCT-scaled libjpeg-turbo decode -> uint8 antialiased resize -> center crop
  prepared   the fast pipeline on images re-encoded by `vlfit prepare` (short side 294, quality 95)
  floor      decode only, at the same DCT scale the fast pipeline uses: nothing else (its ceiling)
  entropy    decode only, at 1/8 scale: the inverse DCT is then a single coefficient per block, so this is close
             to the Huffman decoding every pipeline pays whatever it keeps of the image (what cropping while
             decoding could never save)

One thread per pipeline: the numbers are per core. Each pipeline runs in a process of its own, forked from this
one after the imports a training run makes, as a DataLoader worker is: a worker runs one pipeline, and the
pipelines otherwise disturb each other (the reference's float buffers churn the heap and the caches the others
then refill). Only one process works at a time. Rounds interleave the pipelines so background noise hits all of
them alike; the table reports the median of the rounds and the ratios the project targets. ``--same_process``
runs them all in this process instead, for comparison.

    python benchmarks/loader_throughput.py [--images 48] [--rounds 7] [--size 294] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import simplejpeg
import torch
from PIL import Image

from vlfit.data.image_transforms import FastImageTransform, ReferenceImageTransform
from vlfit.data.prepare.reencode import DEFAULT_JPEG_QUALITY, prepare_image
from vlfit.data.synthetic import SyntheticConfig, make_record
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


def new_yorker_like_jpegs(count: int, width: int = 1024, height: int = 768, quality: int = 90) -> list[bytes]:
    """Textured synthetic scenes re-encoded at exactly ``width x height``, quality 90, 4:2:0."""
    config = SyntheticConfig(num_samples=max(count, 3), min_long_side=width, max_long_side=width, seed=7)
    images = []
    for index in range(count):
        record = make_record(index, config)
        pixels = Image.open(io.BytesIO(record["image"]["bytes"])).convert("RGB").resize((width, height))
        buffer = io.BytesIO()
        pixels.save(buffer, format="JPEG", quality=quality, subsampling=2)
        images.append(buffer.getvalue())
    return images


def images_per_second(function: Callable[[bytes], object], images: list[bytes]) -> float:
    start = time.perf_counter()
    for data in images:
        function(data)
    return len(images) / (time.perf_counter() - start)


def serve_rounds(function: Callable[[bytes], object], images: list[bytes], conn: Connection) -> None:
    """In a forked process: one thread, warm up, then time one round per request until told to stop."""
    torch.set_num_threads(1)
    function(images[0])  # warm-up: allocator, codec tables, lazy imports
    while conn.recv() == "round":
        conn.send(images_per_second(function, images))
    conn.close()


class PipelineProcess:
    """A pipeline timed in a process of its own (forked: it inherits the images and this process's imports)."""

    def __init__(self, function: Callable[[bytes], object], images: list[bytes]) -> None:
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_rounds, args=(function, images, child), daemon=True)
        self.process.start()

    def round(self) -> float:
        self.conn.send("round")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.process.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=294)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--same_process", action="store_true", help="run every pipeline in this process")
    args = parser.parse_args()
    torch.set_num_threads(1)

    originals = new_yorker_like_jpegs(args.images)
    prepared = [prepare_image(data, args.size, DEFAULT_JPEG_QUALITY).data for data in originals]
    reference = ReferenceImageTransform(args.size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    fast = FastImageTransform(args.size)
    size = args.size

    def floor(data: bytes) -> np.ndarray:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=size, min_width=size)

    def entropy_bound(data: bytes) -> np.ndarray:
        height, width = simplejpeg.decode_jpeg_header(data)[:2]
        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // 8), min_width=-(-width // 8))

    pipelines: dict[str, tuple[Callable[[bytes], object], list[bytes]]] = {
        "reference": (reference, originals),
        "fast": (fast, originals),
        "prepared": (fast, prepared),
        "floor": (floor, originals),
        "entropy": (entropy_bound, originals),
    }
    if args.same_process:
        runners = {}
        for function, images in pipelines.values():  # warm-up: allocator, codec tables, lazy imports
            function(images[0])
        timers = {name: functools.partial(images_per_second, *pipeline) for name, pipeline in pipelines.items()}
    else:
        runners = {name: PipelineProcess(function, images) for name, (function, images) in pipelines.items()}
        timers = {name: runner.round for name, runner in runners.items()}
    rounds: dict[str, list[float]] = {name: [] for name in pipelines}
    for _ in range(args.rounds):
        for name, timer in timers.items():
            rounds[name].append(timer())
    for runner in runners.values():
        runner.close()

    median = {name: statistics.median(values) for name, values in rounds.items()}
    mean_kb = sum(map(len, originals)) / len(originals) / 1024
    prepared_kb = sum(map(len, prepared)) / len(prepared) / 1024
    print(f"{args.images} JPEGs 1024x768 q90 4:2:0 ({mean_kb:.0f} KB each; prepared {prepared_kb:.0f} KB) -> "
          f"{size}x{size}, 1 thread, {'one process' if args.same_process else 'a process per pipeline'}, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(f"{'pipeline':<10} {'images/s/core':>14} {'min':>8} {'max':>8} {'vs reference':>13}")
    for name, values in rounds.items():
        print(f"{name:<10} {median[name]:>14.1f} {min(values):>8.1f} {max(values):>8.1f} "
              f"{median[name] / median['reference']:>12.2f}x")  # fmt: skip
    ratios = {
        "fast_vs_reference": median["fast"] / median["reference"],
        "fast_vs_floor": median["fast"] / median["floor"],
        "prepared_vs_reference": median["prepared"] / median["reference"],
    }
    print(
        f"fast/reference {ratios['fast_vs_reference']:.2f}x (target >= 4), "
        f"fast/floor {ratios['fast_vs_floor']:.2f} (target >= 0.85), "
        f"prepared/reference {ratios['prepared_vs_reference']:.2f}x (target >= 10)"
    )
    ms = {name: 1000 / value for name, value in median.items()}
    print(
        f"per image: floor {ms['floor']:.2f} ms, of which about {ms['entropy']:.2f} ms is entropy decoding "
        f"(the 1/8-scale decode); fast adds {ms['fast'] - ms['floor']:.2f} ms to the floor (crop, resize)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "images_per_second": rounds,
                    "median": median,
                    "ratios": ratios,
                    "size": size,
                    "same_process": args.same_process,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
