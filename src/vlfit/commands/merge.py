"""``vlfit merge``: one model from fine-tuned runs of one base, without training: WiSE-FT's mix with the base, a
uniform or greedy soup (Wortsman et al. 2022), or Model Stock (Jang et al. 2024). The runs come from ``--runs`` or
from the best trials of a ``vlfit search`` study (``--search_dir``); the data flags give the held-out split the runs
are ranked on and the greedy soup is judged by (``vlfit eval``'s flags). The merged folder is a run as ``vlfit train``
saves one: ``vlfit eval``, ``export``, ``retrieve index``, ``serve`` and plain transformers load it.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from vlfit.arguments import DataArguments, EvalArguments, ModelArguments
from vlfit.commands.parsing import CommandParser
from vlfit.errors import ConfigError
from vlfit.flags import flag

PROG = "vlfit merge"
METHODS = ("wise", "uniform", "greedy", "stock")
DESCRIPTION = (
    "Merge fine-tuned runs of one base into one model (--method): wise ((1 - --alpha) x --base + --alpha x the run), "
    "uniform (the mean of the runs), greedy (runs in order of their held-out score, each kept only when the soup's "
    "score does not drop) or stock (Model Stock: per tensor, the runs' mean pulled towards --base by the angle "
    "between their changes). The data flags give the held-out split (--eval_split); greedy needs it, the others "
    "report the merged model's scores on it. The merged run goes to --output_dir."
)


@dataclass
class MergeArguments:
    method: str = flag(help="wise, uniform, greedy or stock (see the command's description).", choices=METHODS)
    runs: list[str] | None = flag(
        None, "The runs to merge: checkpoint folders (or LoRA adapters of one base), fine-tuned from one base."
    )
    search_dir: str | None = flag(None, "Merge the --top_k best trials of the vlfit search study in this folder.")
    top_k: int = flag(4, "With --search_dir: how many of the best trials to merge.")
    base: str | None = flag(
        None,
        "The model the runs were fine-tuned from (wise and stock need it; with --search_dir, "
        "stock defaults to the study's model).",
    )
    alpha: float = flag(0.5, "wise: the run's weight (0: --base, 1: the run).")
    metric: str = flag(
        "eval_t2i_recall@1",
        "The held-out score the runs are ranked and the greedy soup judged by (any vlfit eval "
        "reports; eval_ optional).",
    )


def parser() -> CommandParser:
    """The flags of ``vlfit merge``: its own, the data flags of ``vlfit eval`` and its run settings."""
    parsed = CommandParser((MergeArguments, DataArguments, EvalArguments), prog=PROG, description=DESCRIPTION)
    for action in parsed._actions:
        if action.dest == "output_dir":
            action.help = "Required: the merged run's folder (weights, tokenizer, model card, merge.json)."
    return parsed


@dataclass
class ParsedMerge:
    args: MergeArguments
    data: DataArguments
    settings: EvalArguments


def parse_values(values: dict[str, Any]) -> ParsedMerge:
    """``vlfit merge``'s arguments from ``{flag: value}`` (``vlfit.merge``'s keyword arguments)."""
    (args, data, settings), _ = parser().parse_values(values)
    return ParsedMerge(args, data, settings)


def has_held_out_data(data: DataArguments) -> bool:
    return any((data.dataset_name, data.validation_file, data.test_file))


def merge_parsed(parsed: ParsedMerge, command_line: str | None = None) -> Any:
    """Merge with parsed flags (``vlfit merge`` and ``vlfit.merge``); returns the ``MergeResult``."""
    args, data, settings = parsed.args, parsed.data, parsed.settings
    if not settings.output_dir:
        raise ConfigError("--output_dir is required: the merged run's folder")
    if bool(args.runs) == bool(args.search_dir):
        raise ConfigError("pass the runs to merge: --runs RUN [RUN ...], or --search_dir of a vlfit search study")
    metric = args.metric if args.metric.startswith("eval_") else f"eval_{args.metric}"
    from vlfit.merging.methods import check_method
    from vlfit.merging.runs import check_merge_folders, merge_runs
    from vlfit.search.trial_soup import study_runs

    runs, base = list(args.runs or []), args.base
    if args.search_dir:
        runs, study_base = study_runs(args.search_dir, args.top_k)
        base = base or (study_base if args.method == "stock" else None)
    check_method(args.method, len(runs), base, has_held_out_data(data))
    check_merge_folders(runs, base, settings.output_dir)  # before the held-out data and the runs load
    with tempfile.TemporaryDirectory(prefix="vlfit-merge-") as scratch:
        scorer = None
        if has_held_out_data(data):
            from vlfit.commands.evaluate import as_training_arguments
            from vlfit.merging.scoring import WeightsScorer

            model = ModelArguments(model_name_or_path=runs[0])
            training = as_training_arguments(model, dataclasses.replace(settings, output_dir=scratch))
            scorer = WeightsScorer(model, data, training, metric)
        return merge_runs(
            runs,
            method=args.method,
            output_dir=settings.output_dir,
            base=base,
            alpha=args.alpha,
            metric=metric,
            scorer=scorer,
            max_seq_length=data.max_seq_length,
            command_line=command_line,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit merge``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    (args, data, settings), _ = parser().parse(argv)
    result = merge_parsed(ParsedMerge(args, data, settings), command_line="vlfit merge " + shlex.join(argv))
    metric = result.record["metric"]
    if args.method == "greedy":
        kept = ", ".join(result.record["kept"])
        print(f"{PROG}: greedy soup of {len(result.record['kept'])} of {len(result.record['runs'])} runs ({kept}), "
              f"{metric} {result.metrics[metric]:.4f}")  # fmt: skip
    elif result.metrics:
        print(
            f"{PROG}: {args.method} merge of {len(result.record['runs'])} run(s), {metric} {result.metrics[metric]:.4f}"
        )
    print(f"{PROG}: saved to {result.output_dir} (how it was made: {result.output_dir}/merge.json)")
    return 0
