"""Training samples/s with 1 process vs 2 processes (torchrun, gloo) on this CPU, at the same global batch.

Configurations (global batch 48 by default), each a real `vlfit train` run under torchrun on synthetic data:
  1x48           1 process,  batch 48, OMP_NUM_THREADS=2 (the process uses both cores)
  2x24           2 processes, batch 24 each, OMP_NUM_THREADS=1 (one core each), per-process negatives
  2x24 global    the same with --contrastive_negatives global (all-gathered embeddings)
  1x48 1 thread  control: 1 process on one core

``--threads`` sets the thread count of the 1-process run; each of the P processes gets threads / P. Loader workers
are off (``--dataloader_num_workers 0``): each process decodes its own share in line, so both sides do the same
work per sample on the same cores. Rounds alternate the configurations so background load hits all alike; a run's
figure is the median of its logging windows after the first (warm-up), and the table reports the median over
rounds of the global samples/s. Other work on the machine distorts the figures, the 2-thread process most (its
threads wait for each other at every parallel region, spinning by default; ``--omp_wait_policy PASSIVE`` makes
them sleep): the summary prints the load average before and after.

    python benchmarks/scaling.py [--preset small] [--global_batch 48] [--steps 12] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from vlfit.data.synthetic import SyntheticConfig, make_dataset, save_dataset


@dataclass(frozen=True)
class Setup:
    name: str
    processes: int
    negatives: str = "local"
    threads: int | None = None  # per process; default: --threads / processes


SETUPS = (
    Setup("1x{b}", 1),
    Setup("2x{h}", 2),
    Setup("2x{h} global", 2, "global"),
    Setup("1x{b} 1 thread", 1, threads=1),
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(name: str, setup: Setup, args: argparse.Namespace, data: str, work: str) -> float:
    """One `vlfit train` run; returns the median global samples/s of its logging windows after the first."""
    output_dir = tempfile.mkdtemp(dir=work)  # a fresh folder: nothing to resume from
    batch = args.global_batch // setup.processes
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(setup.processes),
               "--master_port", str(free_port()), "-m", "vlfit", "train", "--model_preset", args.preset,
               "--dataset_name", data, "--output_dir", output_dir, "--max_steps",
               str(args.steps), "--logging_steps", str(args.logging_steps), "--per_device_train_batch_size",
               str(batch), "--dataloader_num_workers", "0", "--save_strategy", "no", "--report_to", "none",
               "--contrastive_negatives", setup.negatives]  # fmt: skip
    threads = setup.threads or max(args.threads // setup.processes, 1)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    windows = [entry["samples_per_second"] for entry in history if "samples_per_second" in entry and "loss" in entry]
    if len(windows) < 2:
        raise RuntimeError(f"{name}: {len(windows)} logging windows; raise --steps or lower --logging_steps")
    return statistics.median(windows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--global_batch", type=int, default=48)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--logging_steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of the 1-process run (the cores to use)")
    parser.add_argument("--samples", type=int, default=600, help="synthetic dataset size")
    parser.add_argument(
        "--omp_wait_policy", default=None, help="OMP_WAIT_POLICY for every run (PASSIVE: idle threads sleep)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.global_batch % 2:
        parser.error("--global_batch must be even (it is split over 2 processes)")

    names = [s.name.format(b=args.global_batch, h=args.global_batch // 2) for s in SETUPS]
    readings: dict[str, list[float]] = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "data")
        config = SyntheticConfig(num_samples=args.samples, seed=11, min_long_side=320, max_long_side=480)
        save_dataset(make_dataset(config), data, format="arrow")
        for round_index in range(args.rounds):
            for name, setup in zip(names, SETUPS, strict=True):
                readings[name].append(run_once(name, setup, args, data, work))
                print(f"round {round_index + 1}/{args.rounds}  {name:<14} {readings[name][-1]:8.1f} samples/s")

    medians = {name: statistics.median(values) for name, values in readings.items()}
    load = {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    single = medians[names[0]]
    print(f"\npreset {args.preset}, global batch {args.global_batch}, {args.steps} steps, {args.threads} threads "
          f"in all, OMP_WAIT_POLICY={args.omp_wait_policy or 'unset'}, median of {args.rounds} rounds (global "
          f"samples/s); 1-minute load average {load['before']:.1f} before, {load['after']:.1f} after, on "
          f"{load['cpus']} CPUs")  # fmt: skip
    for name in names:
        print(f"  {name:<14} {medians[name]:8.1f} samples/s   x{medians[name] / single:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "readings": readings, "median": medians, "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
