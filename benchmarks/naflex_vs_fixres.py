"""SigLIP 2 NaFlex against FixRes at the same token budget: training samples/s, loader images/s and the compute
ceiling, through ``vlfit bench``.

The two presets differ only in how images reach the same vision tower: ``siglip2-small`` (NaFlex, ``Siglip2Model``)
keeps each photo's aspect ratio as at most ``--max_num_patches`` 16-pixel patches, padded per batch and masked in
attention; ``siglip2-small-fixres`` (``SiglipModel``, as the FixRes SigLIP 2 checkpoints are) resizes every photo to
a 256 x 256 square, 256 patches. Same widths, depths, parameter count (5.0M), data (``vlfit bench``'s synthetic
photos, the same seed), batch, workers and thread count. The two run in turn, ``--rounds`` times (one bench window
each), and the medians are compared: on a shared machine a load that comes and goes then hits both alike.

    python benchmarks/naflex_vs_fixres.py [--rounds 3] [--batch_size 32] [--workers 2] [--steps 6]
        [--results benchmarks/results/cpu-2core/naflex_vs_fixres.json]

A tiny size for the test suite: ``--naflex_preset siglip2-tiny --fixres_preset siglip-tiny --max_num_patches 16``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_records import machine, rerun_command, write_record


def bench(preset: str, args: argparse.Namespace, output_dir: Path, naflex: bool) -> dict[str, Any]:
    """One ``vlfit bench`` window of ``preset``: loader and train mode, the fast pipeline; its bench.json."""
    argv = [sys.executable, "-m", "vlfit", "bench", "--model_preset", preset, "--mode", "loader,train",
            "--pipelines", "fast", "--workers", str(args.workers), "--per_device_train_batch_size",
            str(args.batch_size), "--steps", str(args.steps), "--warmup_steps", str(args.warmup_steps), "--repeats",
            "1", "--num_samples", str(args.num_samples), "--synthetic_min_long_side", str(args.min_long_side),
            "--synthetic_max_long_side", str(args.max_long_side), "--profile_batches", "0", "--no_png",
            "--cache_dir", str(output_dir.parent / "cache"), "--output_dir", str(output_dir)]  # fmt: skip
    if naflex:
        argv += ["--max_num_patches", str(args.max_num_patches)]
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"vlfit bench --model_preset {preset} failed:\n{done.stderr[-3000:]}")
    return json.loads((output_dir / "bench.json").read_text())


def rates(results: dict[str, Any]) -> dict[str, float]:
    rows = {row["mode"]: row["samples_per_second"] for row in results["rows"] if not row.get("error")}
    return {"train_samples_per_s": rows["train"], "loader_images_per_s": rows["loader"],
            "compute_ceiling_samples_per_s": results["compute"]["samples_per_second"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--naflex_preset", default="siglip2-small")
    parser.add_argument("--fixres_preset", default="siglip2-small-fixres")
    parser.add_argument("--max_num_patches", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--num_samples", type=int, default=192)
    parser.add_argument("--min_long_side", type=int, default=600)
    parser.add_argument("--max_long_side", type=int, default=1400)
    parser.add_argument("--results", default="benchmarks/results/cpu-2core/naflex_vs_fixres.json")
    args = parser.parse_args()

    models = {"naflex": args.naflex_preset, "fixres": args.fixres_preset}
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in models}
    described: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="naflex-vs-fixres-") as temp:
        for round_ in range(args.rounds):
            for kind, preset in models.items():
                results = bench(preset, args, Path(temp) / f"{kind}-{round_}", naflex=kind == "naflex")
                described[kind] = results["settings"]["model"]
                runs[kind].append(rates(results))
                print(f"round {round_ + 1} {kind:6s} {json.dumps(runs[kind][-1])}", flush=True)
    medians = {kind: {name: round(statistics.median(run[name] for run in found), 2) for name in found[0]}
               for kind, found in runs.items()}  # fmt: skip
    ratios = {name: round(medians["naflex"][name] / medians["fixres"][name], 3) for name in medians["naflex"]}
    for kind, values in medians.items():
        print(f"{kind:6s} {described[kind]}: {json.dumps(values)}")
    print(f"naflex / fixres: {json.dumps(ratios)}")

    record = {
        "benchmark": "naflex_vs_fixres",
        "command": rerun_command("naflex_vs_fixres.py", args),
        "models": described,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "machine": machine(),
        "medians": medians,
        "naflex_over_fixres": ratios,
        "runs": runs,
    }
    write_record(record, args.results)


if __name__ == "__main__":
    main()
