"""What `vlfit filter` wins back from noisy captions: the demo's run trained on clean data, on data with a fraction of
its training captions swapped between images, and on what the filter keeps of the noisy data.

1. The demo's data (``vlfit.commands.demo``: its synthetic set and recipe; ``--quick``: the quick demo's sizes).
2. A noisy copy: ``--noise`` (0.3) of the training rows get another chosen row's caption (a random cycle, so every
   chosen row's caption is wrong); validation and test stay clean.
3. A scorer: the demo's recipe trained briefly (``--scorer_epochs``) on the noisy data.
4. ``vlfit filter`` of the noisy training split with the scorer, ``--drop_fraction`` (0.3), through
   ``vlfit.commands.filter.filter_splits``; how many of the dropped rows were swapped is recorded (precision, recall).
5. The demo's run on clean data, on noisy data, and on the filtered noisy data, each for the same number of optimizer
   steps (the noisy run's), evaluated as the demo is (text->image recall@1 over pools of the test split, matching).

    python benchmarks/filter_noise.py [--quick] [--output_dir runs/filter-noise] \\
        [--results benchmarks/results/cpu-2core/filter_noise.json]

Full size (the demo's: 3000 samples, small-p8, 300 steps at batch 48): three runs of about 460 s each on 2 free cores
(docs/demo-recipe.md's small-p8 row), the scorer a third of that, the data about 2 minutes, the scoring under 1:
about 30 minutes. A smoke run of the script (``--quick --max_samples 150 --epochs 2``) takes about a minute; its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import time

import datasets
import numpy as np
from bench_records import machine, rerun_command, write_record
from demo_runs import run_settings, train

from vlfit.commands.demo import QUICK, DemoArguments, ensure_synthetic_data, synthetic_config
from vlfit.commands.filter import filter_splits
from vlfit.data.filtering import Cut
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.sources import open_splits
from vlfit.inference.runtime import ModelRuntime

CAPTION = "image_description"


def swap_captions(data_dir: str, out: str, fraction: float, seed: int) -> set[str]:
    """A copy of ``data_dir`` whose training rows, ``fraction`` of them, carry another chosen row's caption (a
    random cycle: none keeps its own); the ids of those rows."""
    splits = datasets.load_from_disk(data_dir)
    train = splits["train"]
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(train), size=round(len(train) * fraction), replace=False)
    captions = list(train[CAPTION])
    moved = {int(row): captions[int(chosen[(i + 1) % len(chosen)])] for i, row in enumerate(chosen)}
    noisy = train.map(lambda row, index: {CAPTION: moved.get(index, row[CAPTION])}, with_indices=True)
    shutil.rmtree(out, ignore_errors=True)
    datasets.DatasetDict({**splits, "train": noisy}).save_to_disk(out)
    return {train[int(row)]["instance_id"] for row in chosen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="The quick demo's sizes (a smoke run).")
    parser.add_argument("--output_dir", default="runs/filter-noise")
    parser.add_argument("--noise", type=float, default=0.3, help="Fraction of training captions swapped.")
    parser.add_argument("--drop_fraction", type=float, default=0.3, help="What the filter drops.")
    parser.add_argument("--scorer_epochs", type=float, default=None, help="The scorer's epochs (default: a third).")
    parser.add_argument("--max_samples", type=int, default=None, help="Fewer samples (a smoke run of the script).")
    parser.add_argument("--epochs", type=float, default=None, help="Fewer epochs (a smoke run of the script).")
    parser.add_argument("--results", default=None, help="Where the JSON record goes (default: in --output_dir).")
    args = parser.parse_args(argv)
    demo = DemoArguments(output_dir=args.output_dir)
    if args.quick:
        demo = dataclasses.replace(demo, **{**QUICK, "output_dir": args.output_dir})
    if args.max_samples:
        demo = dataclasses.replace(demo, num_samples=args.max_samples)
    if args.epochs:
        demo = dataclasses.replace(demo, num_train_epochs=args.epochs)
    clean_dir = ensure_synthetic_data(os.path.join(args.output_dir, "data"), synthetic_config(demo))
    noisy_dir = os.path.join(args.output_dir, "noisy-data")
    swapped = swap_captions(clean_dir, noisy_dir, args.noise, demo.seed)
    n_train = len(open_splits(dataset_name=noisy_dir)["train"])
    steps = math.floor(n_train / demo.per_device_train_batch_size) * math.ceil(demo.num_train_epochs)
    same_steps = {"max_steps": steps}

    scorer_epochs = args.scorer_epochs or demo.num_train_epochs / 3
    scorer = train(dataclasses.replace(demo, num_train_epochs=scorer_epochs), "scorer", noisy_dir, {})
    filtered_dir = os.path.join(args.output_dir, "filtered")
    start = time.perf_counter()
    train_split = open_splits(dataset_name=noisy_dir, extra_columns=EVAL_COLUMNS)["train"]  # hard negatives kept
    runtime = ModelRuntime.open(scorer["model"])
    cut = Cut(drop_fraction=args.drop_fraction)
    workers = demo.dataloader_num_workers
    (split,) = filter_splits(runtime, {"train": train_split}, filtered_dir, cut, num_workers=workers,
                             columns={"extra_columns": EVAL_COLUMNS})  # fmt: skip
    filter_seconds = round(time.perf_counter() - start)
    kept_ids = {r.id for r in open_splits(dataset_name=filtered_dir)["train"]}
    dropped = set(train_split.ids()) - kept_ids
    caught = len(dropped & swapped)

    runs = {
        "clean": train(demo, "clean", clean_dir, same_steps),
        "noisy": train(demo, "noisy", noisy_dir, same_steps),
        "filtered": train(
            demo, "filtered", noisy_dir, same_steps, train_file=os.path.join(filtered_dir, "train-*.parquet")
        ),  # fmt: skip
    }
    record = {
        "benchmark": "filter_noise",
        "command": rerun_command("filter_noise.py", args),
        "machine": machine(),
        "settings": {
            **run_settings(demo, steps),
            "noise": args.noise,
            "drop_fraction": args.drop_fraction,
            "scorer_epochs": scorer_epochs,
        },  # fmt: skip
        "filter": {
            "seconds": filter_seconds,
            **split.to_dict(),
            "swapped": len(swapped),
            "swapped_dropped": caught,
            "precision": round(caught / max(len(dropped), 1), 3),
            "recall": round(caught / max(len(swapped), 1), 3),
        },  # fmt: skip
        "scorer": scorer,
        "runs": runs,
    }
    write_record(record, args.results or os.path.join(args.output_dir, "filter_noise.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
