"""What stretching a CLIP text tower's positions (Long-CLIP) buys on captions longer than 77 tokens, and what it costs
on short ones: the demo's recipe with a CLIP preset, trained with ``--max_seq_length`` above the tower's 77 positions
and at them.

1. Long captions: ``vlfit make-data --caption_grammar long`` (the demo's scenes and sizes; each caption the regions
   caption after about 100 words every image shares, so they differ only past token 77: the record gives their
   token counts and the first token where any two differ, under the run's own tokenizer).
2. long, 77: the recipe on them at the tower's 77 positions (every caption is cut to the same 77 tokens).
3. long, stretched: the same with ``--max_seq_length`` ``--stretch`` (248: Long-CLIP's 4x, the first 20 positions
   kept and the rest interpolated, ``vlfit.models.long_captions``).
4. short, 77 and short, stretched: the same two on the demo's own captions (``--caption_grammar regions``); the
   issue's bound is the stretched run's recall@1 no more than 0.01 below the other's.

Each run starts from the preset's random init (no pretrained CLIP can be downloaded here, and a tokenizer trained on
short captions splits the shared preamble into about 500 tokens, past any stretch), with the same optimizer steps, and
is evaluated as the demo is: text->image recall@1 over pools of its test split.

    python benchmarks/long_captions.py [--quick] [--output_dir runs/long-captions] [--model_preset clip-tiny] \\
        [--stretch 248] [--max_samples N] [--epochs E] [--results benchmarks/results/cpu-2core/NAME.json]

Full size (the demo's 3000 samples, 300 steps at batch 48, ``clip-tiny``): four runs of about a minute each on 2
free cores (the short ones 53 s, docs/results.md's presets; the long ones longer, their captions being about 140
tokens), the data about a minute: about 6 minutes (9 on 2 shared cores). ``--quick`` (500 samples, 40 epochs at
batch 32): about 8 minutes on 2 shared cores; its figures say only that the script works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from bench_records import machine, rerun_command, write_record
from demo_runs import demo_arguments, run_settings, same_steps, train
from transformers import AutoTokenizer

from vlfit.commands.demo import ensure_synthetic_data, synthetic_config
from vlfit.data.sources import open_splits


def caption_tokens(model: str, data_dir: str) -> dict:
    """The training captions of ``data_dir`` under ``model``'s tokenizer: fewest and most tokens, and the first
    position at which any two differ."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    captions = open_splits(dataset_name=data_dir)["train"].captions()
    ids = [tokenizer(caption)["input_ids"] for caption in captions]
    shared = len(ids[0])
    for row in ids[1:]:
        same = [a == b for a, b in zip(ids[0], row, strict=False)] + [False]  # a shorter caption differs at its end
        shared = min(shared, same.index(False))
    lengths = [len(row) for row in ids]
    return {"min_tokens": min(lengths), "max_tokens": max(lengths), "first_differing_token": shared}


def spec_length(model: str) -> int:
    """The caption length a run trained with (its ``input_spec.json``)."""
    with open(os.path.join(model, "input_spec.json")) as f:
        return int(json.load(f)["max_seq_length"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="The quick demo's sizes (a smoke run).")
    parser.add_argument("--output_dir", default="runs/long-captions")
    parser.add_argument("--model_preset", default="clip-tiny", help="A CLIP (or SigLIP) preset.")
    parser.add_argument("--stretch", type=int, default=248, help="The stretched --max_seq_length.")
    parser.add_argument("--max_samples", type=int, default=None, help="Fewer samples than the demo's.")
    parser.add_argument("--epochs", type=float, default=None, help="Other epochs than the demo's.")
    parser.add_argument("--results", default=None, help="Where the JSON record goes (default: in --output_dir).")
    args = parser.parse_args(argv)
    demo = demo_arguments(args)
    short_dir = ensure_synthetic_data(os.path.join(args.output_dir, "short-data"), synthetic_config(demo))
    long_config = dataclasses.replace(synthetic_config(demo), caption_grammar="long")
    long_dir = ensure_synthetic_data(os.path.join(args.output_dir, "long-data"), long_config)
    steps = same_steps(demo, long_dir)
    overrides = {"max_steps": steps}

    runs = {}
    for data, data_dir in (("long", long_dir), ("short", short_dir)):
        runs[f"{data}, 77"] = train(demo, f"{data}-77", data_dir, overrides)
        runs[f"{data}, stretched"] = train(demo, f"{data}-stretched", data_dir, overrides, max_seq_length=args.stretch)
    for row in runs.values():
        row["max_seq_length"] = spec_length(row["model"])
    short_gap = runs["short, stretched"]["eval_t2i_recall@1"] - runs["short, 77"]["eval_t2i_recall@1"]
    record = {
        "benchmark": "long_captions",
        "command": rerun_command("long_captions.py", args),
        "machine": machine(),
        "settings": {**run_settings(demo, steps), "stretch": args.stretch},
        "long_captions": caption_tokens(runs["long, stretched"]["model"], long_dir),
        "runs": runs,
        "short_stretched_minus_77": round(short_gap, 4),
        "short_within_0.01": short_gap >= -0.01,
    }
    write_record(record, args.results or os.path.join(args.output_dir, "long_captions.json"))
    lines = [
        "| captions | max_seq_length | t2i R@1 | t2i R@5 | i2t R@1 | s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in runs.items():
        cells = " | ".join(f"{row[f'eval_{key}']:.3f}" for key in ("t2i_recall@1", "t2i_recall@5", "i2t_recall@1"))
        lines.append(f"| {name} | {row['max_seq_length']} | {cells} | {row['seconds']} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
