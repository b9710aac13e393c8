"""Best single run vs uniform soup vs greedy soup vs Model Stock, on the quick demo's data; and each mixed with the
starting checkpoint by WiSE-FT. Prints the table docs/merging.md quotes and writes it as JSON.

    python benchmarks/soups.py [--data runs/demo-quick/data] [--start runs/demo-quick/model]
                               [--output_dir runs/soups] [--max_steps 120] [--alpha 0.5]

1. Fine-tunes the quick demo's model (``make demo-quick``) four times on its data, each with its own seed and
   learning rate (``RUNS``), ``--max_steps`` steps each. A run already in ``--output_dir`` is kept.
2. Merges them with ``vlfit.merge``: uniform (all four), greedy (ranked and judged on the validation split), stock
   (with the starting checkpoint as base); the best single run is the one with the best validation t2i recall@1.
3. Mixes each of those with the starting checkpoint (``method="wise"``, ``--alpha``).
4. Evaluates every model on the validation and the test split (pools of 50, as the demo scores): recall@1 both ways
   and matching accuracy (the data's caption choices).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import vlfit

# (seed, learning rate) of the four fine-tunes.
RUNS = [(1, 1e-4), (2, 2e-4), (3, 4e-4), (4, 8e-4)]
METRICS = ("eval_t2i_recall@1", "eval_i2t_recall@1", "eval_matching_accuracy")
SPLITS = ("validation", "test")
RESULTS = os.path.join(os.path.dirname(__file__), "results", "cpu-2core", "soups.json")


def fine_tune(args: argparse.Namespace, seed: int, learning_rate: float) -> str:
    folder = os.path.join(args.output_dir, f"run-seed{seed}-lr{learning_rate:g}")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        vlfit.train(model_name_or_path=args.start, dataset_name=args.data, output_dir=folder, seed=seed,
                    learning_rate=learning_rate, max_steps=args.max_steps, per_device_train_batch_size=32,
                    warmup_steps=5, do_eval=True, eval_pool_size=50, save_strategy="no", report_to="none",
                    disable_tqdm=True)  # fmt: skip
    return folder


def scores(args: argparse.Namespace, folder: str) -> dict[str, dict[str, float]]:
    """The model's metrics on both splits (pools of 50)."""
    found = {}
    for split in SPLITS:
        output_dir = os.path.join(args.output_dir, "eval", os.path.basename(folder), split)
        result = vlfit.evaluate(model_name_or_path=folder, dataset_name=args.data, eval_split=split, eval_pool_size=50,
                                report_to="none", disable_tqdm=True, output_dir=output_dir)  # fmt: skip
        found[split] = {name: float(result.metrics[name]) for name in METRICS if name in result.metrics}
    return found


def merge(args: argparse.Namespace, name: str, **flags: object) -> str:
    folder = os.path.join(args.output_dir, name)
    vlfit.merge(output_dir=folder, report_to="none", disable_tqdm=True, eval_pool_size=50, **flags)
    return folder


def table(rows: list[dict]) -> list[str]:
    header = ["model", *(f"{split} {short}" for split in SPLITS for short in ("t2i R@1", "i2t R@1", "matching"))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row['scores'][split].get(metric, float('nan')):.3f}" for split in SPLITS for metric in METRICS]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="runs/demo-quick/data")
    parser.add_argument("--start", default="runs/demo-quick/model")
    parser.add_argument("--output_dir", default="runs/soups")
    parser.add_argument("--max_steps", type=int, default=120)
    parser.add_argument("--alpha", type=float, default=0.5)
    args = parser.parse_args()
    started = time.monotonic()
    runs = [fine_tune(args, seed, lr) for seed, lr in RUNS]
    single = {run: scores(args, run) for run in runs}
    best = max(runs, key=lambda run: single[run]["validation"]["eval_t2i_recall@1"])
    held_out = {"dataset_name": args.data, "eval_split": "validation"}
    uniform = merge(args, "uniform", method="uniform", runs=runs, base=args.start)
    greedy = merge(args, "greedy", method="greedy", runs=runs, base=args.start, **held_out)
    stock = merge(args, "stock", method="stock", runs=runs, base=args.start)
    with open(os.path.join(greedy, "merge.json"), encoding="utf-8") as f:
        greedy_record = json.load(f)
    with open(os.path.join(stock, "merge.json"), encoding="utf-8") as f:
        stock_ratio = json.load(f)["ratio"]
    models = [("starting checkpoint", args.start), *((f"fine-tune {os.path.basename(r)}", r) for r in runs),
              ("best single run", best), ("uniform soup (4)", uniform),
              (f"greedy soup ({len(greedy_record['kept'])})", greedy), ("Model Stock (4)", stock)]  # fmt: skip
    rows = [{"model": name, "folder": folder, "scores": single.get(folder) or scores(args, folder)}
            for name, folder in models]  # fmt: skip
    wise_rows = []
    for name, folder in models[-4:]:
        mixed = merge(args, f"wise-{os.path.basename(folder)}", method="wise", runs=[folder], base=args.start,
                      alpha=args.alpha)  # fmt: skip
        wise_rows.append({"model": f"WiSE-FT {args.alpha:g}: {name}", "folder": mixed, "scores": scores(args, mixed)})
    lines = ["Each model, then WiSE-FT between the starting checkpoint and it:", "", *table(rows + wise_rows)]
    print("\n".join(lines))
    steps = [(step["run"], round(step["soup_score"], 4), step["kept"]) for step in greedy_record["steps"]]
    print(f"greedy order (run, soup score, kept): {steps}")
    print(f"Model Stock ratio t per tensor: {stock_ratio}")
    record = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "command": f"python benchmarks/soups.py --max_steps {args.max_steps} --alpha {args.alpha:g}",
              "runs": [{"seed": seed, "learning_rate": lr, "folder": run}
                       for (seed, lr), run in zip(RUNS, runs, strict=True)],
              "max_steps": args.max_steps, "best_single_run": best, "greedy": greedy_record["steps"],
              "stock_ratio": stock_ratio, "rows": rows, "wise_ft": wise_rows, "table": lines,
              "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"written: {RESULTS} ({record['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
