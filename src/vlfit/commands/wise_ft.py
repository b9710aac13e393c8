"""``vlfit wise-ft``: the WiSE-FT curve between a zero-shot model and its fine-tuned model, and the chosen mix.

For each alpha, ``theta(alpha) = (1 - alpha) theta_A + alpha theta_B`` (``vlfit.models.interpolation``) is evaluated
as ``vlfit eval`` evaluates: the target split (``--eval_split``) and what must not be forgotten
(``--zeroshot_dataset``). Writes ``wise-ft.json``, ``wise-ft.md`` and ``wise-ft.png`` (both curves against alpha)
and saves the alpha ``--select`` picks as a plain checkpoint with a model card saying how it was made.

This is ``vlfit merge --method wise`` (``--base`` the zero-shot model, ``--runs`` the fine-tuned one, one
``--alpha``) along a curve of alphas, with the alpha chosen on the curve: both mix with the one
``vlfit.models.interpolation.interpolate``, so an alpha gives the same weights through either command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from vlfit.arguments import DataArguments, EvalArguments, ModelArguments
from vlfit.commands.parsing import CommandParser
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.models.reference import parse_model_reference

PROG = "vlfit wise-ft"
SELECTIONS = ("target", "mean")
RESULTS_FILE, TABLE_FILE, CHART_FILE, MODEL_DIR = "wise-ft.json", "wise-ft.md", "wise-ft.png", "model"
# The scores of the target split (vlfit.evaluation.retrieval, .rerank) that --target_metric may name.
TARGET_METRIC = re.compile(r"eval_(?:(?:t2i|i2t)(?:_rerank|_fused)?_recall@(?:1|5|10)|matching_accuracy(?:_itm)?)")
DESCRIPTION = (
    "Evaluate mixes (1 - alpha) x --zeroshot_model + alpha x --finetuned_model (WiSE-FT) on the target split "
    "(--eval_split) and on --zeroshot_dataset, which is required: the labelled data the mix must not forget (its "
    "zero-shot top-1 is the second curve). Writes the curve to --output_dir and saves the alpha --select picks: "
    "vlfit merge --method wise along a curve."
)


@dataclass
class WiseFtArguments:
    zeroshot_model: str = flag(
        help="The model before fine-tuning (theta_A at alpha 0): a checkpoint, or a LoRA run (merged)."
    )
    finetuned_model: str = flag(help="The fine-tuned model (theta_B at alpha 1): a checkpoint, or a LoRA run (merged).")
    alphas: str = flag("0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1", "The mixing weights, comma-separated.")
    target_metric: str = flag(
        "eval_t2i_recall@1",
        "The target split's metric the curve and --select use: eval_t2i_recall@k or eval_i2t_recall@k "
        "(k 1, 5 or 10), eval_matching_accuracy (data with caption choices), eval_t2i_rerank_recall@k or "
        "eval_i2t_rerank_recall@k (--rerank_top_k), eval_t2i_fused_recall@k or eval_i2t_fused_recall@k "
        "(--rerank_top_k with --rerank_score itm+itc).",
    )
    select: str = flag(
        "target",
        "Which alpha is saved: target (the best target metric, among the alphas --max_zeroshot_drop "
        "keeps) or mean (the best mean of the target metric and zero-shot top-1).",
        choices=SELECTIONS,
    )
    max_zeroshot_drop: float | None = flag(
        None, "Keep only alphas whose zero-shot top-1 is at most this much below alpha 0's (e.g. 0.02)."
    )


def check_target_metric(name: str) -> None:
    """Refuse a ``--target_metric`` that no evaluation reports as a score, before any model loads."""
    if not TARGET_METRIC.fullmatch(name):
        raise ConfigError(
            f"--target_metric {name!r} is not a metric of the target split; choose one of eval_t2i_recall@1 (the "
            "default), eval_i2t_recall@1, @5 or @10 of either, eval_matching_accuracy, or with --rerank_top_k "
            "eval_t2i_rerank_recall@k (eval_t2i_fused_recall@k with --rerank_score itm+itc)"
        )


def parse_alphas(text: str) -> list[float]:
    try:
        alphas = [float(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ConfigError(f"--alphas takes comma-separated numbers in [0, 1], got {text!r}") from None
    if not alphas or any(not 0.0 <= alpha <= 1.0 for alpha in alphas):
        raise ConfigError(f"--alphas takes comma-separated numbers in [0, 1], got {text!r}")
    return sorted(set(alphas))


def zeroshot_key(metrics: dict[str, Any]) -> str:
    """The first zero-shot top-1 metric of an evaluation (``eval_zeroshot_top1`` or ``eval_zeroshot_<name>_top1``)."""
    return next(key for key in metrics if key.startswith("eval_zeroshot") and key.endswith("_top1"))


def choose(rows: list[dict[str, Any]], args: WiseFtArguments) -> dict[str, Any]:
    """The row of the alpha ``--select`` and ``--max_zeroshot_drop`` pick (ties: the smaller alpha)."""
    target, zeroshot = args.target_metric, zeroshot_key(rows[0])
    candidates = rows
    if args.max_zeroshot_drop is not None:
        floor = rows[0][zeroshot] - args.max_zeroshot_drop  # rows are sorted by alpha: the first is the lowest
        candidates = [row for row in rows if row[zeroshot] >= floor - 1e-12] or rows[:1]
    if args.select == "mean":
        return max(candidates, key=lambda row: ((row[target] + row[zeroshot]) / 2, -row["alpha"]))
    return max(candidates, key=lambda row: (row[target], -row["alpha"]))


def write_table(path: str, rows: list[dict[str, Any]], target: str, zeroshot: str, chosen: float) -> None:
    lines = [f"| alpha | {target} | {zeroshot} | |", "| --- | --- | --- | --- |"]
    for row in rows:
        mark = "saved" if row["alpha"] == chosen else ""
        lines.append(f"| {row['alpha']:g} | {row[target]:.4f} | {row[zeroshot]:.4f} | {mark} |")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_chart(path: str, rows: list[dict[str, Any]], target: str, zeroshot: str, chosen: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = [row["alpha"] for row in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(alphas, [row[target] for row in rows], marker="o", label=f"target: {target}")
    axes.plot(alphas, [row[zeroshot] for row in rows], marker="s", label=f"kept: {zeroshot}")
    axes.axvline(chosen, color="grey", linestyle=":", label=f"saved: alpha {chosen:g}")
    axes.set_xlabel("alpha (0: zero-shot model, 1: fine-tuned model)")
    axes.set_ylabel("metric")
    axes.set_title("WiSE-FT: weight-space interpolation")
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit wise-ft``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = CommandParser((WiseFtArguments, DataArguments, EvalArguments), prog=PROG, description=DESCRIPTION)
    for action in parser._actions:
        if action.dest == "zeroshot_dataset":
            action.help = f"Required by vlfit wise-ft. {action.help}"
    (args, data, settings), _ = parser.parse(argv)
    if not settings.output_dir:
        raise ConfigError("--output_dir is required: where the curve and the chosen model go")
    if not data.zeroshot_dataset:
        raise ConfigError(
            "--zeroshot_dataset is required: the labelled data WiSE-FT must not forget (its zero-shot top-1 is "
            "the second curve), e.g. --zeroshot_dataset DATA --zeroshot_label_column label"
        )
    check_target_metric(args.target_metric)
    alphas = parse_alphas(args.alphas)
    for option, model in (("--zeroshot_model", args.zeroshot_model), ("--finetuned_model", args.finetuned_model)):
        if parse_model_reference(model, flag=option).answers_questions:
            raise ConfigError(
                f"{option} {model} answers questions (vlfit train --task vqa): vlfit wise-ft mixes a contrastive model "
                "with its fine-tuning along a zero-shot classification curve, which a VQA model has no embeddings for"
            )

    from vlfit.commands.evaluate import as_training_arguments
    from vlfit.model_card import WiseFtMix, write_model_card
    from vlfit.models.interpolation import interpolate
    from vlfit.models.loading import build_model, resolve_model, save_inputs
    from vlfit.training.run import run, setup_run

    finetuned_args = ModelArguments(model_name_or_path=args.finetuned_model)
    zeroshot_args = ModelArguments(model_name_or_path=args.zeroshot_model)
    training = as_training_arguments(finetuned_args, settings)
    setup = setup_run(finetuned_args, data, training)
    zeroshot_spec = resolve_model(
        **zeroshot_args.source_keywords(), max_seq_length=data.max_seq_length, max_num_patches=data.max_num_patches
    )
    if zeroshot_spec.family.name != setup.spec.family.name:
        raise ConfigError(
            f"--zeroshot_model is a {zeroshot_spec.family.name} model and --finetuned_model a "
            f"{setup.spec.family.name} one: WiSE-FT mixes a model with its own fine-tuning"
        )
    if zeroshot_spec.inputs.tokenizer.get_vocab() != setup.spec.inputs.tokenizer.get_vocab():
        raise ConfigError("the two models' tokenizers differ: --finetuned_model is no fine-tuning of --zeroshot_model")
    theta_a = build_model(zeroshot_spec, **zeroshot_args.build_keywords()).state_dict()
    theta_b = build_model(setup.spec, **finetuned_args.build_keywords()).state_dict()

    rows = []
    for number, alpha in enumerate(alphas, 1):
        # Each alpha's evaluation prints its metric table: say first which mix it is.
        print(f"\nvlfit wise-ft: alpha {alpha:g} ({number} of {len(alphas)}): (1 - {alpha:g}) x --zeroshot_model + "
              f"{alpha:g} x --finetuned_model", flush=True)  # fmt: skip
        output_dir = os.path.join(settings.output_dir, f"alpha-{alpha:g}")
        alpha_training = as_training_arguments(finetuned_args, dataclasses.replace(settings, output_dir=output_dir))
        mixed = interpolate(theta_a, theta_b, alpha)
        metrics = run(finetuned_args, data, alpha_training, setup=setup, state_dict=mixed)
        rows.append({"alpha": alpha, **{key: value for key, value in metrics.items() if key.startswith("eval_")}})
    if args.target_metric not in rows[0]:  # a score this data has none of (caption choices, re-ranking)
        scores = sorted(key for key in rows[0] if TARGET_METRIC.fullmatch(key))
        raise ConfigError(f"--target_metric {args.target_metric!r}: this evaluation has no such metric; choose one of "
                          f"{scores}")  # fmt: skip
    zeroshot = zeroshot_key(rows[0])
    chosen = choose(rows, args)

    folder = os.path.join(settings.output_dir, MODEL_DIR)
    model = build_model(setup.spec, **finetuned_args.build_keywords())
    model.load_state_dict(interpolate(theta_a, theta_b, chosen["alpha"]))
    model.save_pretrained(folder)
    save_inputs(setup.spec, folder)
    target_file = data.validation_file or data.test_file
    evaluated = [f"the `{data.eval_split}` split of `{data.dataset_name}`"] if data.dataset_name else []
    evaluated += [f"`{target_file}`"] if target_file and not data.dataset_name else []
    evaluated += [f"`{name}` zero-shot" for name in data.zeroshot_dataset]
    write_model_card(
        folder,
        family_name=setup.spec.family.name,
        base_model=None,
        preset=None,
        datasets=[],  # the two endpoints' cards name their training data; this mix was only evaluated
        metrics={key: value for key, value in chosen.items() if key != "alpha"},
        command_line="vlfit wise-ft " + shlex.join(argv),
        mix=WiseFtMix(chosen["alpha"], zeroshot_model=args.zeroshot_model, finetuned_model=args.finetuned_model),
        how_made=f"Alpha {chosen['alpha']:g} was chosen by --select {args.select}"
        + (f", --max_zeroshot_drop {args.max_zeroshot_drop:g}" if args.max_zeroshot_drop is not None else "")
        + f" among alphas {', '.join(f'{a:g}' for a in alphas)}, each evaluated on {' and '.join(evaluated)}; "
        "the results below are the mix's.",
    )
    results = {"zeroshot_model": args.zeroshot_model, "finetuned_model": args.finetuned_model,
               "target_metric": args.target_metric, "zeroshot_metric": zeroshot, "select": args.select,
               "max_zeroshot_drop": args.max_zeroshot_drop, "chosen_alpha": chosen["alpha"], "model": folder,
               "alphas": rows}  # fmt: skip
    with open(os.path.join(settings.output_dir, RESULTS_FILE), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    write_table(os.path.join(settings.output_dir, TABLE_FILE), rows, args.target_metric, zeroshot, chosen["alpha"])
    write_chart(os.path.join(settings.output_dir, CHART_FILE), rows, args.target_metric, zeroshot, chosen["alpha"])
    print(f"vlfit wise-ft: alpha {chosen['alpha']:g} saved to {folder} ({args.target_metric} "
          f"{chosen[args.target_metric]:.4f}, {zeroshot} {chosen[zeroshot]:.4f}); curve in "
          f"{os.path.join(settings.output_dir, TABLE_FILE)}")  # fmt: skip
    return 0
