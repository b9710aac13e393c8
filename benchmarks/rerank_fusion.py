"""Cosine, ITM-only and fused (ITM + weight x cosine) re-ranking on the quick demo's data: three rows of recall@1/5.

    python benchmarks/rerank_fusion.py [--data runs/demo-quick/data] [--start runs/demo-quick/model]
                                       [--output_dir runs/rerank-fusion] [--epochs 10] [--top_k 16]

1. Trains an ITM run: the quick demo's model (``make demo-quick``) fine-tuned with ``--objective contrastive+itm`` on
   the same data, evaluated on its validation split at the end, which sweeps the ``itm+itc`` weight and saves it
   (``rerank.json``). Skipped when ``--output_dir`` already holds the run.
2. Evaluates the run on the test split, pools of 50 as the demo scores, re-ranking each query's top ``--top_k``
   (and 4, 8, 16) by the matching head alone and fused with the saved weight.
3. Prints the table (markdown) the docs quote, with the commands that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import vlfit


def train_flags(args: argparse.Namespace) -> dict[str, object]:
    return dict(model_name_or_path=args.start, dataset_name=args.data, objective="contrastive+itm",
                num_train_epochs=args.epochs, per_device_train_batch_size=32, learning_rate=5e-4,
                eval_pool_size=50, do_eval=True, eval_split="validation", save_strategy="no", report_to="none",
                disable_tqdm=True, output_dir=args.output_dir)  # fmt: skip


def eval_flags(args: argparse.Namespace) -> dict[str, object]:
    return dict(model_name_or_path=args.output_dir, dataset_name=args.data, eval_split="test", eval_pool_size=50,
                rerank_top_k=args.top_k, report_to="none", disable_tqdm=True,
                output_dir=os.path.join(args.output_dir, "test"))  # fmt: skip


def command(name: str, flags: dict[str, object]) -> str:
    parts = ["vlfit", name]
    for flag, value in flags.items():
        parts += [f"--{flag}", str(value)]
    return shlex.join(parts)


def table(metrics: dict[str, float]) -> list[str]:
    """The cosine row, then the ITM and fused rows of each K evaluation reported (``top_k`` among them)."""
    weight = metrics["eval_rerank_weight"]

    def cells(prefix: str) -> str:
        return " | ".join(f"{metrics[f'eval_{way}_{prefix}recall@{k}']:.3f}" for way in ("t2i", "i2t") for k in (1, 5))

    lines = ["| ranking | t2i R@1 | t2i R@5 | i2t R@1 | i2t R@5 | ms/query |", "|---|---|---|---|---|---|",
             f"| cosine | {cells('')} | |"]  # fmt: skip
    ks = sorted(int(key[len("eval_rerank_top") : -len("_ms_per_query")]) for key in metrics
                if key.startswith("eval_rerank_top") and key.endswith("_ms_per_query"))  # fmt: skip
    for k in ks:
        ms = metrics[f"eval_rerank_top{k}_ms_per_query"]
        lines.append(f"| ITM, top {k} | {cells(f'rerank_top{k}_')} | {ms:.1f} |")
        lines.append(f"| ITM + {weight:g} x cosine, top {k} | {cells(f'fused_top{k}_')} | {ms:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="runs/demo-quick/data")
    parser.add_argument("--start", default="runs/demo-quick/model")
    parser.add_argument("--output_dir", default="runs/rerank-fusion")
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--top_k", type=int, default=16)
    args = parser.parse_args(argv)
    for path, make in ((args.data, "make demo-quick"), (args.start, "make demo-quick")):
        if not os.path.isdir(path):
            print(f"rerank_fusion: {path}: no such folder; run {make} first", file=sys.stderr)
            return 2
    if not os.path.isfile(os.path.join(args.output_dir, "rerank.json")):
        vlfit.train(**train_flags(args))
    metrics = vlfit.evaluate(**eval_flags(args)).metrics
    with open(os.path.join(args.output_dir, "rerank.json"), encoding="utf-8") as f:
        saved = json.load(f)
    print(f"# {command('train', train_flags(args))}")
    print(f"# {command('eval', eval_flags(args))}")
    print(f"# weight {saved['rerank_weight']:g}: swept on the {saved['split']} split, top {saved['top_k']}")
    print("\n".join(table(metrics)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
