"""The best of N short ``vlfit search`` trials against ``vlfit train``'s default flags, at the same steps.

On ``vlfit make-data`` data and the ``small`` preset (random init), four runs, each a real command:

  defaults        ``vlfit train`` with the default learning rate, warmup and weight decay (TrainingArguments'),
                  then ``vlfit eval`` on the test split
  search median   ``vlfit search --n_trials N --pruner median`` (default space: learning rate, warmup, weight
                  decay, initial logit scale), evaluating every ``steps / 4`` steps; its best trial's model (kept in
                  ``trial-K/``) evaluated on the test split
  search none     the same study without pruning (same evaluations), for the wall time pruning saves

Every run trains the same number of steps at the same batch size and seed; the test split is never seen by the
search (it optimizes validation recall@1). The table gives test recall@1 (text->image and image->text) and each
search's wall time. Prints a markdown table; ``--json`` keeps the figures.

How long: a `small` trial of 100 steps at batch 32 trains 3,200 samples, about 1.4 minutes at the 38.9 samples/s
`vlfit demo` reaches on an idle 2-core CPU, plus its 4 evaluations and start-up: about 2 minutes. One 12-trial
study unpruned is then about 25 minutes, and the whole benchmark (data, defaults, two studies, test evaluations)
about 50 minutes on an idle machine (an estimate, not a measurement; other work on the cores slows it several
times over). Each finished step is kept in ``<out>/timings.json``: rerunning the same command skips it, so an
interrupted benchmark continues where it stopped. ``--n_trials 2 --steps 8 --batch 16 --num_samples 300`` checks
the script end to end.

    python benchmarks/search_vs_defaults.py [--out runs/search-bench] [--n_trials 12] [--steps 100]
        [--batch 32] [--num_samples 3000] [--json benchmarks/results/cpu-2core/search.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

METRICS = ("eval_t2i_recall@1", "eval_i2t_recall@1", "eval_matching_accuracy")


def vlfit(*args: str, log: str) -> float:
    """Run ``python -m vlfit ARGS`` with its output in ``log``; returns the wall time in seconds."""
    start = time.monotonic()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "vlfit", *args], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"vlfit {' '.join(args)} failed ({done.returncode}); see {log}")
    return time.monotonic() - start


def test_metrics(model_dir: str, data: str, pool: int, out: str, label: str) -> dict[str, float]:
    """``vlfit eval`` of a trained model on the test split."""
    eval_dir = os.path.join(out, "test-eval", label)
    os.makedirs(eval_dir, exist_ok=True)
    vlfit(
        "eval", "--model_name_or_path", model_dir, "--dataset_name", data, "--eval_split", "test",
        "--eval_pool_size", str(pool), "--output_dir", eval_dir, "--report_to", "none",
        log=f"{eval_dir}.log",
    )  # fmt: skip
    with open(os.path.join(eval_dir, "eval_results.json")) as f:
        results = json.load(f)
    return {name: results[name] for name in METRICS if name in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/search-bench")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--n_trials", type=int, default=12)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--num_samples", type=int, default=3000)
    parser.add_argument("--pool", type=int, default=100, help="recall@k over pools of this many pairs")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "data")
    timings_file = os.path.join(args.out, "timings.json")
    timings: dict[str, float] = {}
    if os.path.isfile(timings_file):
        with open(timings_file) as f:
            timings = json.load(f)

    def timed(name: str, *vlfit_args: str, log: str) -> float:
        """Run a step once; its wall time is kept, so a rerun skips it (``vlfit search`` itself resumes too)."""
        if name not in timings:
            timings[name] = vlfit(*vlfit_args, log=log)
            with open(timings_file, "w") as f:
                json.dump(timings, f, indent=1)
        return timings[name]

    if not os.path.isdir(data):
        timed(
            "make-data",
            "make-data", "--output_dir", data, "--num_samples", str(args.num_samples), "--seed", str(args.seed),
            log=os.path.join(args.out, "make-data.log"),
        )  # fmt: skip
    common = [
        "--model_preset", args.preset, "--dataset_name", data, "--max_steps", str(args.steps),
        "--per_device_train_batch_size", str(args.batch), "--eval_pool_size", str(args.pool),
        "--dataloader_num_workers", str(args.workers), "--seed", str(args.seed), "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", str(max(args.steps // 10, 1)), "--disable_tqdm", "true",
    ]  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}

    defaults_dir = os.path.join(args.out, "defaults")
    timed("defaults", "train", *common, "--output_dir", defaults_dir, log=f"{defaults_dir}.log")
    rows["defaults"] = {"params": {}, **test_metrics(defaults_dir, data, args.pool, args.out, "defaults")}

    eval_every = max(args.steps // 4, 1)
    for pruner in ("median", "none"):
        name = f"search, pruner {pruner}"
        out = os.path.join(args.out, f"search-{pruner}")
        timed(
            name,
            "search", *common, "--output_dir", out, "--n_trials", str(args.n_trials), "--pruner", pruner,
            "--eval_strategy", "steps", "--eval_steps", str(eval_every), log=f"{out}.log",
        )  # fmt: skip
        with open(os.path.join(out, "search.json")) as f:
            study = json.load(f)
        best = study["best"]
        rows[name] = {
            "params": best["params"],
            "best_trial": best["number"],
            "validation_recall@1": best["value"],
            "states": study["states"],
            "wall_s": round(timings[name], 1),
            **test_metrics(best["run_dir"], data, args.pool, args.out, f"search-{pruner}"),
        }

    lines = [
        f"preset {args.preset}, {args.steps} steps at batch {args.batch}, {args.n_trials} trials per search, "
        f"test split, pools of {args.pool}",
        "",
        "| run | test t2i R@1 | test i2t R@1 | matching | search wall time | trials | parameters |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row["params"].items())
        states = ", ".join(f"{n} {s}" for s, n in row.get("states", {}).items())
        wall = f"{row['wall_s'] / 60:.1f} min" if "wall_s" in row else ""
        lines.append(
            f"| {name} | {row.get('eval_t2i_recall@1', float('nan')):.3f} | "
            f"{row.get('eval_i2t_recall@1', float('nan')):.3f} | {row.get('eval_matching_accuracy', float('nan')):.3f} "
            f"| {wall} | {states} | {params or 'TrainingArguments defaults'} |"
        )
    print("\n".join(lines))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "timings_s": timings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
