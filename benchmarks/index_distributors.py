"""``vlfit retrieve index`` through each distributor on one machine: one process, ``torchrun`` with N processes, and
``--distributor ray`` with N actors (a local Ray cluster of N CPU slots): images/s, and what each costs to start.

Two synthetic datasets (``vlfit make-data``: ``--images`` and ``--small`` images) and a checkpoint of the tiny preset
(``vlfit train --max_steps 1``) are made once in ``--out``. Each build is one command in a fresh process over a new
index folder, timed from start to exit (interpreter, model, the engine's start, embedding, writing, the ANN step),
over each dataset; images/s is the difference of images over the difference of seconds (what
each further image costs), setup the time of the small build less its images at that rate (what the build costs
before and after its images: for Ray, joining the cluster, starting the actors, each opening the model). The Ray
cluster is started once with ``ray start --head --block --num-cpus N`` (timed apart, until ``ray status`` answers:
``cluster_start_s``) and joined with ``--ray_address auto``, as a cluster in use is; it is stopped at the end (its
``ray start`` process, by its id).

    python benchmarks/index_distributors.py [--images 2000] [--small 20] [--processes 2] [--shard_size 256]
        [--out runs/index-dist] [--results benchmarks/results/cpu-2core]

Writes ``index_distributors.json`` to ``--results`` (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLFIT = [sys.executable, "-m", "vlfit"]
BIN = Path(sys.executable).parent


def run(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds ``argv`` took, start to exit (it must succeed)."""
    started = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def prepare(out: Path, sizes: tuple[int, ...]) -> tuple[list[Path], Path]:
    """The synthetic datasets of ``sizes`` images and the tiny checkpoint (made once)."""
    datasets, model = [out / f"data-{size}" for size in sizes], out / "model"
    for size, data in zip(sizes, datasets, strict=True):
        if not data.exists():
            run([*VLFIT, "make-data", "--output_dir", str(data), "--num_samples", str(size), "--validation_fraction",
                 "0.0", "--test_fraction", "0.0", "--seed", str(size)])  # fmt: skip
    data = datasets[0]
    if not model.exists():
        run([*VLFIT, "train", "--model_preset", "tiny", "--dataset_name", str(data), "--output_dir", str(model),
             "--max_steps", "1", "--per_device_train_batch_size", "2", "--save_strategy", "no", "--report_to",
             "none", "--disable_tqdm", "true"])  # fmt: skip
    return datasets, model


def start_cluster(processes: int) -> tuple[subprocess.Popen, float]:
    """``ray start --head --block`` of ``processes`` CPU slots, and the seconds until ``ray status`` answered."""
    started = time.perf_counter()
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", str(processes),
                             "--include-dashboard", "false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    status = [str(BIN / "ray"), "status", "--address", "auto"]
    token = {**os.environ, "RAY_AUTH_MODE": "token"}  # ray start enables token authentication; ray status must ask
    while subprocess.run(status, capture_output=True, env=token).returncode:
        if head.poll() is not None or time.perf_counter() - started > 120:
            head.kill()
            raise SystemExit("ray start --head did not come up within 120 s")
        time.sleep(0.5)
    return head, time.perf_counter() - started


def build(kind: str, data: Path, model: Path, folder: Path, processes: int, shard_size: int) -> float:
    """Seconds one build of ``data``'s images took through ``kind``."""
    shutil.rmtree(folder, ignore_errors=True)
    flags = ["retrieve", "index", "--model", str(model), "--dataset_name", str(data), "--split", "train",
             "--output_dir", str(folder), "--batch_size", "16", "--shard_size", str(shard_size),
             "--dataloader_num_workers", "0", "--disable_tqdm", "true"]  # fmt: skip
    if kind == "one process":
        return run([*VLFIT, *flags], {"OMP_NUM_THREADS": str(processes)})
    if kind == "torchrun":
        return run([str(BIN / "torchrun"), "--nproc_per_node", str(processes), "-m", "vlfit", *flags],
                   {"OMP_NUM_THREADS": "1"})  # fmt: skip
    return run([*VLFIT, *flags, "--distributor", "ray", "--ray_address", "auto"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--shard_size", type=int, default=256)
    parser.add_argument("--out", default="runs/index-dist")
    parser.add_argument("--results", default="benchmarks/results/cpu-2core")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (data, small_data), model = prepare(out, (args.images, args.small))
    head, cluster_start = start_cluster(args.processes)
    rows = []
    try:
        for kind in ("one process", "torchrun", "ray"):
            small = build(kind, small_data, model, out / "index", args.processes, args.shard_size)
            full = build(kind, data, model, out / "index", args.processes, args.shard_size)
            rate = (args.images - args.small) / (full - small)
            rows.append({"distributor": kind, "processes": 1 if kind == "one process" else args.processes,
                         "images_per_s": round(rate, 1), "setup_s": round(small - args.small / rate, 2),
                         "small_build_s": round(small, 2), "build_s": round(full, 2)})  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        head.terminate()  # ray start --block stops the cluster's processes as it exits
        head.wait(timeout=60)
    report = {"images": args.images, "small": args.small, "shard_size": args.shard_size,
              "cluster_start_s": round(cluster_start, 2), "rows": rows,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)", "preset": "tiny"}  # fmt: skip
    Path(args.results).mkdir(parents=True, exist_ok=True)
    (Path(args.results) / "index_distributors.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"ray start (local cluster of {args.processes} CPU slots): {cluster_start:.1f} s")
    for row in rows:
        print(f"{row['distributor']:<12} x{row['processes']}  {row['images_per_s']:>7.1f} images/s  setup "
              f"{row['setup_s']:>5.1f} s  ({row['build_s']:.1f} s for {args.images})")  # fmt: skip


if __name__ == "__main__":
    main()
