"""Forgetting and WiSE-FT: fine-tune the ``make demo`` model on a shifted distribution, measure what it gains there
and what it loses on the one it was trained on, then the WiSE-FT curve between the two models.

No pretrained weights can be downloaded here, so "pretrained" is the model ``vlfit demo`` trains (``small-p8`` on
3000 synthetic scenes, light backgrounds, captions that say where each group is). The shifted distribution is the
same kind of scene drawn on dark backgrounds and captioned without regions ("a picture of two red circles and one
blue square."): ``make-data --background dark --caption_grammar no_regions`` (another seed, so no image repeats).

Measured at every alpha of ``theta(alpha) = (1 - alpha) theta_pretrained + alpha theta_finetuned`` (alpha 0 is the
model before fine-tuning, 1 after), with ``vlfit wise-ft`` (once per retrieval split):

- target: text->image recall@1 on the shifted test split (pool of 100 images, as the demo reports);
- original retrieval: the same on the demo's own test split;
- original zero-shot: top-1 on ``make-data --labels region`` (where the scene's one group is, 5 classes; 400 test
  images, seed 1), prompts in the original grammar as ``benchmarks/fewshot.py`` uses them ("one red circle {}.").

The goal (the shape of the WiSE-FT paper's result): some alpha keeps >= 95% of the pretrained zero-shot accuracy
and >= 80% of the fine-tuned gain on the target.

    python benchmarks/forgetting.py [--pretrained runs/demo/model] [--demo_data runs/demo/data]
        [--out runs/forgetting] [--results benchmarks/results/cpu-2core]

Needs ``make demo`` first (its model and data). About 10 minutes on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from vlfit.cli import main as vlfit
from vlfit.data.synthetic import COLOUR_NAMES, KINDS

TEMPLATES = [f"one {colour} {kind} {{}}." for colour in COLOUR_NAMES for kind in KINDS]
TARGET = "eval_t2i_recall@1"
ZEROSHOT = "eval_zeroshot_top1"
IMAGE_SIZES = ["--min_long_side", "320", "--max_long_side", "640"]


def run(argv: list[str]) -> None:
    code = vlfit(argv)
    if code != 0:
        sys.exit(f"vlfit {' '.join(argv[:1])} exited {code}")


def make_data(path: str, flags: list[str]) -> str:
    if not os.path.isdir(path):
        run(["make-data", *flags, *IMAGE_SIZES, "--output_dir", path])
    return path


def wise_ft(args: argparse.Namespace, finetuned: str, dataset: str, zeroshot: str, out: str) -> list[dict]:
    run(["wise-ft", "--zeroshot_model", args.pretrained, "--finetuned_model", finetuned, "--alphas", args.alphas,
         "--dataset_name", dataset, "--eval_split", "test", "--eval_pool_size", "100",
         "--per_device_eval_batch_size", "100", "--zeroshot_dataset", zeroshot, "--zeroshot_label_column", "region",
         "--prompt_template", *TEMPLATES, "--select", "target", "--max_zeroshot_drop", "0.05",
         "--output_dir", out])  # fmt: skip
    with open(os.path.join(out, "wise-ft.json")) as f:
        return json.load(f)["alphas"]


def summarize(target_rows: list[dict], original_rows: list[dict]) -> dict:
    """One row per alpha with the three curves, and which alphas meet the goal."""
    rows = []
    for shifted, original in zip(target_rows, original_rows, strict=True):
        assert shifted["alpha"] == original["alpha"]
        rows.append({"alpha": shifted["alpha"], "target_t2i@1": shifted[TARGET], "target_i2t@1":
                     shifted["eval_i2t_recall@1"], "original_t2i@1": original[TARGET],
                     "original_zeroshot_top1": shifted[ZEROSHOT]})  # fmt: skip
    before, after = rows[0], rows[-1]
    gain = after["target_t2i@1"] - before["target_t2i@1"]
    for row in rows:
        row["zeroshot_kept"] = row["original_zeroshot_top1"] / before["original_zeroshot_top1"]
        row["gain_kept"] = (row["target_t2i@1"] - before["target_t2i@1"]) / gain if gain > 0 else float("nan")
        row["meets_goal"] = row["zeroshot_kept"] >= 0.95 and row["gain_kept"] >= 0.80
    return {"gain": gain, "forgotten_zeroshot": before["original_zeroshot_top1"] - after["original_zeroshot_top1"],
            "goal_alphas": [row["alpha"] for row in rows if row["meets_goal"]], "rows": rows}  # fmt: skip


def table(summary: dict) -> str:
    lines = ["| alpha | target t2i@1 | target i2t@1 | original t2i@1 | original zero-shot top-1 | zero-shot kept | "
             "gain kept |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for row in summary["rows"]:
        mark = " **goal**" if row["meets_goal"] else ""
        lines.append(f"| {row['alpha']:g}{mark} | {row['target_t2i@1']:.3f} | {row['target_i2t@1']:.3f} | "
                     f"{row['original_t2i@1']:.3f} | {row['original_zeroshot_top1']:.3f} | "
                     f"{100 * row['zeroshot_kept']:.0f}% | {100 * row['gain_kept']:.0f}% |")  # fmt: skip
    return "\n".join(lines)


def chart(path: str, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    alphas = [row["alpha"] for row in rows]
    figure, (curves, frontier) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, marker in (("target_t2i@1", "target (shifted): t2i recall@1", "o"),
                               ("original_t2i@1", "original: t2i recall@1", "^"),
                               ("original_zeroshot_top1", "original: zero-shot top-1 (region)", "s")):  # fmt: skip
        curves.plot(alphas, [row[key] for row in rows], marker=marker, label=label)
    curves.set_xlabel("alpha (0: pretrained, 1: fine-tuned)")
    curves.set_ylabel("metric")
    curves.set_title("WiSE-FT curve")
    curves.legend(loc="best", fontsize=8)
    frontier.plot([row["original_zeroshot_top1"] for row in rows], [row["target_t2i@1"] for row in rows], marker="o")
    for row in rows:
        frontier.annotate(f"{row['alpha']:g}", (row["original_zeroshot_top1"], row["target_t2i@1"]), fontsize=7,
                          xytext=(3, 3), textcoords="offset points")  # fmt: skip
    frontier.set_xlabel("original zero-shot top-1 (what is kept)")
    frontier.set_ylabel("target t2i recall@1 (what is gained)")
    frontier.set_title("kept against gained, alpha annotated")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrained", default="runs/demo/model")
    parser.add_argument("--demo_data", default="runs/demo/data", help="make demo's dataset (original retrieval).")
    parser.add_argument("--out", default="runs/forgetting")
    parser.add_argument("--results", default=None, help="Also write forgetting.{json,md,png} here.")
    parser.add_argument("--alphas", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    parser.add_argument("--num_train_epochs", default="4")
    parser.add_argument("--learning_rate", default="2e-4")
    args = parser.parse_args()
    for path in (args.pretrained, args.demo_data):
        if not os.path.isdir(path):
            sys.exit(f"{path}: missing; run make demo first (it trains the model and writes the data this uses)")
    started = time.perf_counter()
    shifted = make_data(os.path.join(args.out, "shifted"), ["--num_samples", "1500", "--seed", "2", "--background",
                                                            "dark", "--caption_grammar", "no_regions"])  # fmt: skip
    region = make_data(os.path.join(args.out, "region"), ["--labels", "region", "--num_samples", "1000", "--seed",
                                                          "1", "--validation_fraction", "0", "--test_fraction",
                                                          "0.4"])  # fmt: skip
    finetuned = os.path.join(args.out, "finetuned")
    if not os.path.isfile(os.path.join(finetuned, "config.json")):
        run(["train", "--model_name_or_path", args.pretrained, "--dataset_name", shifted, "--do_train",
             "--num_train_epochs", args.num_train_epochs, "--learning_rate", args.learning_rate,
             "--per_device_train_batch_size", "48", "--weight_decay", "0.05", "--warmup_steps", "0.05",
             "--lr_scheduler_type", "cosine", "--dataloader_num_workers", "1", "--dataloader_drop_last",
             "--logging_steps", "10", "--save_strategy", "no", "--report_to", "none", "--seed", "0",
             "--disable_tqdm", "true", "--output_dir", finetuned])  # fmt: skip
    target_rows = wise_ft(args, finetuned, shifted, region, os.path.join(args.out, "wise-ft-target"))
    original_rows = wise_ft(args, finetuned, args.demo_data, region, os.path.join(args.out, "wise-ft-original"))
    summary = summarize(target_rows, original_rows)
    summary.update(pretrained=args.pretrained, num_train_epochs=float(args.num_train_epochs),
                   learning_rate=float(args.learning_rate),
                   benchmark_minutes=round((time.perf_counter() - started) / 60, 1))  # fmt: skip
    text = table(summary)
    goal = ", ".join(f"{a:g}" for a in summary["goal_alphas"]) or "none"
    print(f"\nfine-tuned gain on the target (t2i@1): {summary['gain']:+.3f}; zero-shot forgotten: "
          f"{summary['forgotten_zeroshot']:+.3f}; alphas meeting the goal: {goal}\n{text}")  # fmt: skip
    for folder in filter(None, (args.out, args.results)):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "forgetting.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(folder, "forgetting.md"), "w") as f:
            f.write(text + "\n")
        chart(os.path.join(folder, "forgetting.png"), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
