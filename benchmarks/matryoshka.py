"""What Matryoshka training buys at small sizes and costs at the full size: the demo's run trained with and without
``--matryoshka_dims`` (1/2, 1/4 and 1/8 of the embedding), each evaluated by ``vlfit eval --embedding_dim d`` at every
size (text->image recall@1 over pools of the test split, as the demo scores it).

1. The demo's data and recipe (``vlfit.commands.demo``: its synthetic set, preset, steps and evaluation; ``--quick``:
   the quick demo's sizes, with ``--epochs`` (default 25 under ``--quick``) to fit about 2 minutes).
2. The run without Matryoshka, then the same run (same seed, data, steps) with ``--matryoshka_dims`` at the
   fractions ``--fractions`` (2,4,8) of the embedding size the first run's evaluation records.
3. ``vlfit eval`` of each run at the full size and at each of those sizes, through ``vlfit.evaluate`` (the Python
   door of the command, same flags).

    python benchmarks/matryoshka.py [--quick] [--output_dir runs/matryoshka] \\
        [--results benchmarks/results/cpu-2core/matryoshka.json]

Full size (the demo's: 3000 samples, small-p8 at 128 dimensions, 300 steps at batch 48): two runs of about 460 s
each on 2 free cores (docs/demo-recipe.md), the Matryoshka run's loss three more cheap terms; the evaluations under a
minute. ``--quick`` (tiny at 64 dimensions, 500 samples, 25 epochs at batch 32): about 2 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from bench_records import machine, rerun_command, write_record
from demo_runs import train

import vlfit
from vlfit.commands.demo import QUICK, DemoArguments, ensure_synthetic_data, recipe, synthetic_config
from vlfit.models.matryoshka import DEFAULT_PREFIX_WEIGHT

METRICS = ("t2i_recall@1", "t2i_recall@5", "i2t_recall@1", "matching_accuracy")


def evaluate(demo: DemoArguments, model: str, data_dir: str, size: int | None) -> dict:
    """``vlfit eval --embedding_dim size`` of ``model`` (None: the full size) on the demo's evaluation split, pools and
    image pipeline; its metrics, unprefixed."""
    data_args = recipe(demo, data_dir)[1]
    flags = {"model_name_or_path": model, "dataset_name": data_dir, "eval_split": data_args.eval_split,
             "eval_pool_size": data_args.eval_pool_size, "image_pipeline": data_args.image_pipeline,
             "per_device_eval_batch_size": 100, "dataloader_num_workers": demo.dataloader_num_workers,
             "output_dir": os.path.join(model, f"eval-{size or 'full'}"), "disable_tqdm": True,
             "seed": demo.seed}  # fmt: skip
    if size is not None:
        flags["embedding_dim"] = size
    metrics = vlfit.evaluate(**flags).metrics
    return {key.removeprefix("eval_"): value for key, value in metrics.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="The quick demo's sizes, 25 epochs (about 2 minutes).")
    parser.add_argument("--output_dir", default="runs/matryoshka")
    parser.add_argument("--fractions", default="2,4,8", help="Sizes trained and evaluated: the full size over these.")
    parser.add_argument("--epochs", type=float, default=None, help="Training epochs (default: the demo's; quick: 25).")
    parser.add_argument("--max_samples", type=int, default=None, help="Fewer samples (a smoke run of the script).")
    parser.add_argument("--prefix_weight", type=float, default=DEFAULT_PREFIX_WEIGHT,
                        help="vlfit train --matryoshka_prefix_weight (1.0: the paper's plain mean).")  # fmt: skip
    parser.add_argument("--results", default=None, help="Where the JSON record goes (default: in --output_dir).")
    args = parser.parse_args(argv)
    demo = DemoArguments(output_dir=args.output_dir)
    if args.quick:
        demo = dataclasses.replace(demo, **{**QUICK, "output_dir": args.output_dir, "num_train_epochs": 25.0})
    if args.epochs:
        demo = dataclasses.replace(demo, num_train_epochs=args.epochs)
    if args.max_samples:
        demo = dataclasses.replace(demo, num_samples=args.max_samples)
    data_dir = ensure_synthetic_data(os.path.join(args.output_dir, "data"), synthetic_config(demo))

    plain_run = train(demo, "without", data_dir, {"do_eval": False})
    plain, plain_seconds = plain_run["model"], plain_run["seconds"]
    without = {None: evaluate(demo, plain, data_dir, None)}
    full = int(without[None]["embedding_dim"])
    sizes = sorted({full // int(fraction) for fraction in args.fractions.split(",")}, reverse=True)
    dims = ",".join(str(size) for size in sorted(sizes))
    nested_flags = {"do_eval": False, "matryoshka_dims": dims, "matryoshka_prefix_weight": args.prefix_weight}
    nested_run = train(demo, "with", data_dir, nested_flags)
    nested, nested_seconds = nested_run["model"], nested_run["seconds"]
    with_ = {None: evaluate(demo, nested, data_dir, None)}
    for size in sizes:
        without[size] = evaluate(demo, plain, data_dir, size)
        with_[size] = evaluate(demo, nested, data_dir, size)

    rows = [{"embedding_dim": full if size is None else size,
             "without": {m: round(without[size][m], 4) for m in METRICS if m in without[size]},
             "with": {m: round(with_[size][m], 4) for m in METRICS if m in with_[size]}}
            for size in (None, *sizes)]  # fmt: skip
    chance = without[None]["chance_recall@1"]
    print(f"\ntext->image recall@1 over pools of {int(without[None]['pool_size'])} (chance {chance:.3f})")
    print(f"{'size':>6}  {'without':>8}  {'with':>8}   (--matryoshka_dims {dims})")
    for row in rows:
        print(f"{row['embedding_dim']:>6}  {row['without']['t2i_recall@1']:>8.3f}  {row['with']['t2i_recall@1']:>8.3f}")
    record = {
        "benchmark": "matryoshka",
        "command": rerun_command("matryoshka.py", args),
        "machine": machine(),
        "settings": {
            "num_samples": demo.num_samples,
            "model_preset": demo.model_preset,
            "num_train_epochs": demo.num_train_epochs,
            "batch_size": demo.per_device_train_batch_size,
            "learning_rate": demo.learning_rate,
            "eval_pool_size": demo.eval_pool_size,
            "embedding_dim": full,
            "matryoshka_dims": dims,
            "matryoshka_prefix_weight": args.prefix_weight,
            "seed": demo.seed,
        },  # fmt: skip
        "chance_recall@1": round(chance, 4),
        "train_seconds": {"without": plain_seconds, "with": nested_seconds},
        "rows": rows,
    }
    print(json.dumps(rows))
    write_record(record, args.results or os.path.join(args.output_dir, "matryoshka.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
