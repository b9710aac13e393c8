"""``vlfit fewshot`` on a labelled synthetic set with the model ``vlfit demo`` fine-tunes: zero-shot, linear probe
and SetFit at 1-16 labelled images per class, 5 seeds, accuracy on the test split.

The labelled set is ``vlfit make-data --labels region`` (5 classes: where the scene's one group of shapes is; seed
1, so none of its images is in the demo's training data). Region, not shape kind or colour, because it is what the
demo model's image embeddings carry *partly*: a linear probe on 600 labelled images reaches about 0.36 on kind
(chance 0.31: the 80-pixel small-p8 model does not tell shapes apart), about 0.98 on colour already at 4 shots
(nothing left to compare), and region lies between. Zero-shot prompts follow the captions' grammar: "one red circle
{}." for every colour and kind (24 templates, averaged), the class names being the region phrases ("on the left").

SetFit runs without random crops and flips (``--no_setfit_augment``): a flip turns "on the left" into "on the
right", a crop moves the group. Its learning rate (2e-5, SetFit's default body learning rate) and step count were
chosen on the validation split, never on the test split. A second SetFit run with plain logistic heads only
(``--no_anchor_setfit_head``) shows what the head's zero-shot anchor adds to the fine-tuning.

    python benchmarks/fewshot.py [--model runs/demo/model] [--out runs/fewshot-bench]
        [--results benchmarks/results/cpu-2core]

Needs ``make demo`` first (its model). Takes about 10 minutes on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from vlfit.cli import main as vlfit
from vlfit.data.synthetic import COLOUR_NAMES, KINDS

TEMPLATES = [f"one {colour} {kind} {{}}." for colour in COLOUR_NAMES for kind in KINDS]


def run(argv: list[str]) -> None:
    code = vlfit(argv)
    if code != 0:
        sys.exit(f"vlfit {' '.join(argv[:1])} exited {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/demo/model")
    parser.add_argument("--out", default="runs/fewshot-bench")
    parser.add_argument("--results", default=None, help="Also copy fewshot.{json,md,png} here.")
    parser.add_argument("--shots", default="1,2,4,8,16")
    parser.add_argument("--seeds", default="5")
    args = parser.parse_args()
    if not os.path.isdir(args.model):
        sys.exit(f"{args.model}: no model; run make demo first (it trains the model this benchmark uses)")
    data = os.path.join(args.out, "data")
    if not os.path.isdir(data):
        run(["make-data", "--labels", "region", "--num_samples", "1500", "--seed", "1", "--min_long_side", "320",
             "--max_long_side", "640", "--output_dir", data])  # fmt: skip
    common = ["fewshot", "--model_name_or_path", args.model, "--dataset_name", data, "--label_column", "region",
              "--eval_split", "test", "--shots", args.shots, "--seeds", args.seeds, "--no_setfit_augment",
              "--prompt_template", *TEMPLATES]  # fmt: skip
    started = time.perf_counter()
    run([*common, "--output_dir", os.path.join(args.out, "main")])
    run([*common, "--output_dir", os.path.join(args.out, "plain-head"), "--methods", "setfit",
         "--no_anchor_setfit_head"])  # fmt: skip
    minutes = (time.perf_counter() - started) / 60
    with open(os.path.join(args.out, "main", "fewshot.json")) as f:
        main_doc = json.load(f)
    with open(os.path.join(args.out, "plain-head", "fewshot.json")) as f:
        plain = json.load(f)
    main_doc["ablation_setfit_plain_logistic_head"] = plain["summary"]["setfit"]
    main_doc["benchmark_minutes"] = round(minutes, 1)
    shots = main_doc["shots"]
    rows = {**main_doc["summary"], "setfit, plain logistic head": plain["summary"]["setfit"]}
    lines = ["| method | " + " | ".join(str(s) for s in shots) + " |", "|---|" + "---:|" * len(shots)]
    for method, summary in rows.items():
        cells = [summary.get(str(s), summary.get("0")) for s in shots]
        lines.append(f"| {method} | " + " | ".join(f"{c['mean']:.3f} ± {c['std']:.3f}" for c in cells) + " |")
    table = "\n".join(lines)
    print(f"\nlabelled images per class -> test accuracy (mean ± std over {args.seeds} seeds; chance "
          f"{main_doc['chance']:.3f}; {minutes:.1f} min)\n{table}")  # fmt: skip
    with open(os.path.join(args.out, "main", "fewshot.json"), "w") as f:
        json.dump(main_doc, f, indent=1)
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        for name in ("fewshot.json", "fewshot.png"):
            shutil.copy(os.path.join(args.out, "main", name), os.path.join(args.results, name))
        with open(os.path.join(args.results, "fewshot.md"), "w") as f:
            f.write(f"`python benchmarks/fewshot.py --results {args.results}` (model: {args.model}, labelled set: "
                    f"make-data --labels region, seed 1; test split, {main_doc['eval_images']} images)\n\n"
                    f"{table}\n\nAccuracy, mean ± standard deviation over {args.seeds} seeds; chance (the most "
                    f"frequent class) {main_doc['chance']:.3f}. Zero-shot uses no labelled image.\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
