"""SigLIP 2 NaFlex input: vlfit's loader beside ``Siglip2ImageProcessor`` and beside the codec floor, on the same files
and the same DataLoader workers, and the padding each batching wastes.

Generated photo-like JPEGs (gradients, waves, noise, a block; ``--images`` of them, long side 480 to 2400 px, aspect
ratios from 1:3 to 3:1, a quarter with EXIF orientation 6) are held as bytes, so no pipeline reads the disk. Each
pipeline runs in a DataLoader of ``--workers`` worker processes (one torch thread each), batches of ``--batch_size``:

- vlfit: ``InputPipeline`` for ``siglip2-small`` (budget ``--max_num_patches``): header, grid, DCT-scaled decode, one
  uint8 resize, uint8 patches padded to the batch's longest, then the device stage on the CPU (normalization, in the
  main process), as ``vlfit train`` feeds a CPU model; ``vlfit_uint8_batches``: the loader's uint8 batches alone (on a
  GPU the normalization is the device's); ``vlfit_decode_margin_1``: decoded at the smallest power-of-two scale
  covering the grid itself instead of twice its sides (``vlfit.data.naflex.DECODE_MARGIN``: faster, and further
  from the processor's full decode at small budgets);
- processor: what a transformers user writes: each image opened as ``transformers.image_utils.load_image`` opens it
  (Pillow, EXIF orientation, RGB) and the batch through ``Siglip2ImageProcessor`` (``return_tensors="pt"``) in the
  workers' collate;
- floor: every image decoded at full size by libjpeg-turbo (simplejpeg, RGB) and nothing else: what any pipeline
  that decodes the whole image pays at least.

Goals: vlfit >= 4x the processor, >= 0.75x the floor. Padding waste (padded patches over all patches of the batches)
is computed from each image's grid (the header and the processor's grid search, what the loader makes): the
processor pads every image to the budget; vlfit pads each batch to its longest image, in a shuffled order (``vlfit
train``'s default) and in the order ``--train_sampling_strategy group_by_length`` reads (``PatchCountGroupedSampler``:
shuffled windows of up to 50 batches, each sorted by patch count).

    python benchmarks/naflex_loader.py [--images 256] [--batch_size 32] [--workers 2] [--max_num_patches 256]
        [--repeats 3] [--results benchmarks/results/cpu-2core/naflex_loader.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable, Iterable

import numpy as np
import simplejpeg
import torch
from bench_records import machine, rerun_command, write_record
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset

from vlfit.data import naflex
from vlfit.data.naflex import image_header
from vlfit.data.patch_count_grouping import PatchCountGroupedSampler, patch_counts
from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions
from vlfit.data.records import Record
from vlfit.data.sources.memory import MemorySource
from vlfit.models.loading import resolve_model

ASPECTS = (1 / 3, 9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9, 3.0)
PRESET = "siglip2-small"


def photo_jpeg(rng: np.random.Generator) -> bytes:
    """One photo-like JPEG of a random size and aspect ratio (a quarter stored rotated, EXIF orientation 6)."""
    long_side = int(rng.integers(480, 2401))
    aspect = float(rng.choice(ASPECTS))
    width, height = (long_side, max(16, round(long_side / aspect))) if aspect >= 1 else (
        max(16, round(long_side * aspect)), long_side)  # fmt: skip
    small = (max(8, width // 8), max(8, height // 8))  # drawn at 1/8, then upsampled: photo-like, and fast to make
    y, x = np.mgrid[0 : small[1], 0 : small[0]].astype(np.float32)
    base = np.stack([255 * x / small[0], 255 * y / small[1], 128 + 100 * np.sin(x / 5 + y / 7)], -1)
    base[small[1] // 3 : small[1] // 2, small[0] // 5 : small[0] // 2] = (250, 20, 20)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).resize((width, height), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, 4, (height, width, 3)).astype(np.float32)
    options: dict = {"quality": 90}
    if rng.random() < 0.25:
        exif = Image.Exif()
        exif[0x0112] = 6
        options["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


class Bytes(Dataset):
    """The encoded files, each through ``transform`` in the worker."""

    def __init__(self, files: list[bytes], transform: Callable[[bytes], object]) -> None:
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> object:
        return self.transform(self.files[index])


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)


def open_as_transformers_does(data: bytes) -> Image.Image:
    """``transformers.image_utils.load_image`` of a file: Pillow, EXIF orientation applied, RGB."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def decode_full(data: bytes) -> int:
    return int(simplejpeg.decode_jpeg(data, colorspace="RGB").shape[0])


class ProcessorCollate:
    def __init__(self, max_num_patches: int) -> None:
        from transformers import Siglip2ImageProcessor

        self.processor = Siglip2ImageProcessor(patch_size=16, max_num_patches=max_num_patches)

    def __call__(self, images: list[Image.Image]) -> int:
        return int(self.processor(images=images, return_tensors="pt")["pixel_values"].shape[0])


def timed(batches: Iterable[object], count: Callable[[object], int]) -> float:
    start, seen = time.perf_counter(), 0
    for batch in batches:
        seen += count(batch)
    return seen / (time.perf_counter() - start)


def measure(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, dict[str, object]]:
    """Each pipeline's images/s, the pipelines taking turns in each repeat (so a busy spell of the shared machine
    falls on all of them), median of the repeats."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            rates[name].append(run())
    results = {}
    for name, found in rates.items():
        median = statistics.median(found)
        print(f"{name:22s} images/s median {median:8.1f}  (runs {', '.join(f'{r:.1f}' for r in found)})")
        results[name] = {"images_per_s": round(median, 1), "runs": [round(r, 1) for r in found]}
    return results


def waste(counts: list[int], batch_size: int, budget: int) -> dict[str, float]:
    """Padded patches over all patches of the batches of ``counts`` in order: padded to the budget, and to each
    batch's longest."""
    used = sum(counts)
    batches = [counts[s : s + batch_size] for s in range(0, len(counts), batch_size)]
    to_longest = sum(len(batch) * max(batch) for batch in batches)
    return {"padded_to_budget": round(1 - used / (len(counts) * budget), 4),
            "padded_to_batch_longest": round(1 - used / to_longest, 4)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max_num_patches", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="benchmarks/results/cpu-2core/naflex_loader.json")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    files = [photo_jpeg(rng) for _ in range(args.images)]
    megapixels = [image_header(data)[0] * image_header(data)[1] / 1e6 for data in files]
    print(f"{len(files)} JPEGs, {statistics.median(megapixels):.2f} megapixels median, "
          f"{sum(len(f) for f in files) / 2**20:.1f} MiB")  # fmt: skip

    spec = resolve_model(model_preset=PRESET, captions=lambda: ["a photo"] * 8, max_num_patches=args.max_num_patches)
    inputs = spec.inputs
    settings = LoaderSettings(num_workers=args.workers, prefetch_factor=4, persistent_workers=False)
    loader_options = {"batch_size": args.batch_size, "num_workers": args.workers, "worker_init_fn": _one_thread,
                      "prefetch_factor": 4}  # fmt: skip

    def run_vlfit() -> float:
        pipeline = InputPipeline(inputs, PipelineOptions(), torch.device("cpu"), keep_columns=())
        source = MemorySource([Record(str(i), data, "a photo") for i, data in enumerate(files)], "photos")
        loader = pipeline.loader(pipeline.dataset(source, train=False), batch_size=args.batch_size, settings=settings)
        return timed(pipeline.feed(loader, torch.float32, train=False), len)

    def run_vlfit_host() -> float:  # the loader's uint8 batches alone (on a GPU, normalization is the device's)
        pipeline = InputPipeline(inputs, PipelineOptions(), torch.device("cpu"), keep_columns=())
        source = MemorySource([Record(str(i), data, "a photo") for i, data in enumerate(files)], "photos")
        return timed(pipeline.loader(pipeline.dataset(source, train=False), batch_size=args.batch_size,
                                     settings=settings), len)  # fmt: skip

    def run_vlfit_margin_1() -> float:  # decoded at the smallest scale covering the grid itself (see naflex.py)
        default, naflex.DECODE_MARGIN = naflex.DECODE_MARGIN, 1
        try:  # the workers fork from here and read the module's value
            return run_vlfit()
        finally:
            naflex.DECODE_MARGIN = default

    def run_processor() -> float:
        collate = ProcessorCollate(args.max_num_patches)
        return timed(DataLoader(Bytes(files, open_as_transformers_does), collate_fn=collate, **loader_options), int)

    def run_floor() -> float:
        return timed(DataLoader(Bytes(files, decode_full), collate_fn=len, **loader_options), int)

    torch.set_num_threads(1)
    runs = {
        "vlfit": run_vlfit,
        "vlfit_uint8_batches": run_vlfit_host,
        "vlfit_decode_margin_1": run_vlfit_margin_1,
        "processor": run_processor,
        "floor": run_floor,
    }
    results = measure(runs, args.repeats)
    vlfit_rate = results["vlfit"]["images_per_s"]
    ratios = {"vs_processor": round(vlfit_rate / results["processor"]["images_per_s"], 2),
              "vs_floor": round(vlfit_rate / results["floor"]["images_per_s"], 2),
              "uint8_batches_vs_processor": round(
                  results["vlfit_uint8_batches"]["images_per_s"] / results["processor"]["images_per_s"], 2),
              "uint8_batches_vs_floor": round(
                  results["vlfit_uint8_batches"]["images_per_s"] / results["floor"]["images_per_s"], 2),
              "decode_margin_1_vs_processor": round(
                  results["vlfit_decode_margin_1"]["images_per_s"] / results["processor"]["images_per_s"], 2),
              "decode_margin_1_vs_floor": round(
                  results["vlfit_decode_margin_1"]["images_per_s"] / results["floor"]["images_per_s"], 2)}  # fmt: skip

    photos = MemorySource([Record(str(i), data, "a photo") for i, data in enumerate(files)], "photos")
    counts = patch_counts(photos, 16, args.max_num_patches)  # what the loader cuts, as group_by_length counts
    shuffled = [counts[i] for i in rng.permutation(len(counts))]
    grouped = [counts[i] for i in PatchCountGroupedSampler(counts, args.batch_size, args.seed)]
    padding = {"shuffled": waste(shuffled, args.batch_size, args.max_num_patches),
               "group_by_length": waste(grouped, args.batch_size, args.max_num_patches)}  # fmt: skip
    print(
        f"vlfit / processor {ratios['vs_processor']}x (goal >= 4), vlfit / floor {ratios['vs_floor']}x (goal >= 0.75)"
    )
    print(f"padding waste: {json.dumps(padding)}")

    record = {
        "benchmark": "naflex_loader",
        "command": rerun_command("naflex_loader.py", args),
        "preset": PRESET,
        "max_num_patches": args.max_num_patches,
        "images": len(files),
        "median_megapixels": round(statistics.median(megapixels), 2),
        "patches_per_image": {"min": min(counts), "median": statistics.median(counts), "max": max(counts)},
        "batch_size": args.batch_size,
        "workers": args.workers,
        "machine": machine(),
        "results": results,
        "ratios": ratios,
        "goals": {"vs_processor": 4.0, "vs_floor": 0.75},
        "padding_waste": padding,
    }
    write_record(record, args.results)


if __name__ == "__main__":
    main()
