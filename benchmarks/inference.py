"""Inference speed and accuracy of each backend: PyTorch eager fp32, ONNX Runtime fp32 and INT8, OpenVINO f32, bf16
(``--precision bf16``, where the CPU has AMX or AVX-512 bf16), its default precision (bf16 where the CPU has it) and
INT8, on the same cores, with the CPU named (its model and matrix features).

For each backend and batch size: images/s and captions/s, and p50/p95 latency of one call of each tower (the image
tower from uint8 pixels, the text tower from token ids); then text->image recall@1 of each on the evaluation
samples, and its change against PyTorch. The exports are made by ``vlfit export``'s code (parity checked, INT8
calibrated on the calibration samples, which are not the evaluation samples when the split has enough).

    python benchmarks/inference.py --model_name_or_path runs/demo/model --dataset_name runs/demo/data
    python benchmarks/inference.py --model_preset small   # random weights, synthetic scenes: speed only

Without a dataset, synthetic scenes are made on the spot; a preset gets random weights (its recall is chance).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from vlfit.commands.export import SYNTHETIC_LONG_SIDE
from vlfit.data.sources.openers import open_split
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.efficiency.cpu import cpu_info
from vlfit.inference.backends import Encoder, ExportedEncoder
from vlfit.inference.export import ExportSettings, embed_samples, export_model, t2i_recall
from vlfit.inference.export_samples import Samples, load_samples
from vlfit.inference.exported import ExportFolder
from vlfit.inference.graph_runtimes import OnnxRuntimeGraphs, OpenVinoGraphs
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings


def save_preset_checkpoint(preset: str, folder: Path, captions: list[str]) -> Path:
    """A random-init checkpoint of ``preset`` with a tokenizer trained on ``captions``."""
    from vlfit.arguments import ModelArguments
    from vlfit.models.loading import build_model, resolve_model

    args = ModelArguments(model_preset=preset)
    spec = resolve_model(**args.source_keywords(), captions=lambda: captions)
    torch.manual_seed(0)
    build_model(spec, **args.build_keywords()).save_pretrained(folder)
    spec.inputs.tokenizer.save_pretrained(folder)
    spec.image_processor.save_pretrained(folder)
    return folder


def latency(call: Callable[[], object], iterations: int, warmup: int = 2) -> tuple[float, float]:
    """p50 and p95 seconds of ``call``."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]


def make_encoder(name: str, checkpoint: str, work: Path, threads: int) -> Encoder:
    """The encoder of one row of the table."""
    if name == "torch eager fp32":
        return ModelRuntime.open(checkpoint, RuntimeSettings(backend="torch", num_threads=threads)).encoder
    fmt, precision = name.split()
    exported = ExportFolder.open(str(work / ("onnx" if fmt == "onnxruntime" else "openvino")))
    if fmt == "onnxruntime":
        return ExportedEncoder(exported, OnnxRuntimeGraphs(num_threads=threads), precision)
    if precision == "default":
        return ExportedEncoder(exported, OpenVinoGraphs(num_threads=threads), "fp32")
    if precision == "bf16":  # as a user asks for it: the runtime's settings, refused on a CPU without bf16 units
        return ModelRuntime.open(str(work / "openvino"), RuntimeSettings(precision="bf16", num_threads=threads)).encoder
    hint = "f32" if precision == "f32" else None
    return ExportedEncoder(exported, OpenVinoGraphs(hint, threads), "fp32" if precision == "f32" else "int8")


BACKENDS = ("torch eager fp32", "onnxruntime fp32", "onnxruntime int8", "openvino f32", "openvino bf16",
            "openvino default", "openvino int8")  # fmt: skip


def measure_backend(
    name: str, checkpoint: str, work: Path, threads: int, samples: Samples, batch_sizes: list[int], iterations: int
) -> dict:
    """One backend's row, in a process of its own (started by ``spawn``): the thread pools of the runtimes measured
    before it (ONNX Runtime's spin after each call) would otherwise compete with it for the cores."""
    torch.set_num_threads(threads)
    return measure(make_encoder(name, checkpoint, work, threads), samples, batch_sizes, iterations)


def measure(encoder: Encoder, samples: Samples, batch_sizes: list[int], iterations: int) -> dict:
    row: dict = {}
    for batch in batch_sizes:
        pixels = samples.pixels[:batch].contiguous()
        if pixels.shape[0] < batch:  # repeat the samples up to the batch size
            pixels = pixels.repeat((batch // pixels.shape[0]) + 1, 1, 1, 1)[:batch].contiguous()
        captions = (samples.captions * (batch // len(samples.captions) + 1))[:batch]
        tokens = encoder.tokenize(captions)
        p50, p95 = latency(lambda pixels=pixels: encoder.encode_images(pixels), iterations)
        row[f"image_b{batch}"] = {"per_s": round(batch / p50, 1), "p50_ms": round(p50 * 1e3, 2),
                                  "p95_ms": round(p95 * 1e3, 2)}  # fmt: skip
        p50, p95 = latency(lambda tokens=tokens: encoder.encode_tokens(**tokens), iterations)
        row[f"text_b{batch}"] = {"per_s": round(batch / p50, 1), "p50_ms": round(p50 * 1e3, 2),
                                 "p95_ms": round(p95 * 1e3, 2)}  # fmt: skip
    images, texts = embed_samples(samples, encoder.encode_images, encoder.encode_tokens, encoder.tokenize)
    row["t2i_recall@1"] = t2i_recall(texts, images)["t2i_recall@1"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model_name_or_path", help="A checkpoint folder (e.g. the one vlfit demo trains).")
    model.add_argument("--model_preset", help="Or a preset with random weights (speed only).")
    parser.add_argument("--dataset_name", help="Evaluation and calibration samples (default: synthetic scenes).")
    parser.add_argument("--eval_split", default="validation")
    parser.add_argument("--calibration_split", default="train")
    parser.add_argument("--eval_samples", type=int, default=256)
    parser.add_argument("--calibration_samples", type=int, default=300)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="Threads of every runtime.")
    parser.add_argument("--work_dir", help="Where the exports go (default: a temporary folder).")
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vlfit-inference-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.dataset_name:
        eval_source = open_split(args.dataset_name, args.eval_split)
        calibration_source = open_split(args.dataset_name, args.calibration_split)
    else:
        low, high = SYNTHETIC_LONG_SIDE
        eval_source = synthetic_source(args.eval_samples, seed=1, min_long_side=low, max_long_side=high)
        calibration_source = synthetic_source(args.calibration_samples, seed=2, min_long_side=low, max_long_side=high)
    checkpoint = args.model_name_or_path
    if checkpoint is None:
        checkpoint = str(save_preset_checkpoint(args.model_preset, work / "checkpoint", calibration_source.captions()))
    loaded = ModelRuntime.open(checkpoint).encoder
    eval_samples = load_samples(eval_source.select(range(min(args.eval_samples, len(eval_source)))), loaded.spec)
    calibration = load_samples(
        calibration_source.select(range(min(args.calibration_samples, len(calibration_source)))), loaded.spec
    )
    exports = {}
    for fmt in ("onnx", "openvino"):
        start = time.perf_counter()
        manifest = export_model(
            loaded,
            str(work / fmt),
            ExportSettings(fmt, "int8"),
            parity_samples=eval_samples,
            calibration_samples=calibration,
        )
        exports[fmt] = {"seconds": round(time.perf_counter() - start, 1), "parity": manifest["parity"]}
        print(f"exported {fmt} in {exports[fmt]['seconds']} s: parity {json.dumps(manifest['parity'])}", flush=True)

    results = {}
    context = multiprocessing.get_context("spawn")
    cpu = cpu_info()
    print(f"CPU: {cpu.describe()}", flush=True)
    for name in BACKENDS:
        if name == "openvino bf16" and not (cpu.has_amx_bf16 or "avx512_bf16" in cpu.features):
            print(f"{name}: left out, this CPU has no bf16 matrix units", flush=True)
            continue
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            job = pool.submit(measure_backend, name, checkpoint, work, args.threads, eval_samples, args.batch_sizes,
                              args.iterations)  # fmt: skip
            results[name] = job.result()
        print(name, json.dumps(results[name]), flush=True)

    reference = results["torch eager fp32"]
    print(f"\n{len(eval_samples)} evaluation samples, {args.threads} threads, model {checkpoint}, CPU {cpu.describe()}")
    columns = [f"{tower}_b{b}" for b in args.batch_sizes for tower in ("image", "text")]
    print(f"{'backend':<18}" + "".join(f"{c + ' /s (p50/p95 ms)':>30}" for c in columns) + f"{'R@1 (change)':>16}")
    for name, row in results.items():
        cells = "".join(
            f"{row[c]['per_s']:>10.1f} ({row[c]['p50_ms']:.1f}/{row[c]['p95_ms']:.1f})".rjust(30) for c in columns
        )
        change = row["t2i_recall@1"] - reference["t2i_recall@1"]
        print(f"{name:<18}{cells}{row['t2i_recall@1']:>9.3f} ({change:+.3f})")
    for b in args.batch_sizes:
        key = f"image_b{b}"
        speedup = results["onnxruntime int8"][key]["per_s"] / reference[key]["per_s"]
        print(f"image tower, batch {b}: onnxruntime int8 is {speedup:.2f}x torch eager fp32", end="; ")
        best = max((n for n in results if n != "torch eager fp32"), key=lambda n: results[n][key]["per_s"])
        speedup = results["openvino int8"][key]["per_s"] / reference[key]["per_s"]
        print(f"openvino int8 {speedup:.2f}x; best {best} {results[best][key]['per_s'] / reference[key]['per_s']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"exports": exports, "results": results, "threads": args.threads, **cpu.record()}, f, indent=1)


if __name__ == "__main__":
    main()
