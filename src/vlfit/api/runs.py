"""``vlfit.train``, ``vlfit.evaluate`` and ``vlfit.merge``: the commands of a run, with their flags as keyword
arguments, returning a ``RunResult``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlfit.errors import python_api, unknown_keywords


@dataclass
class RunResult:
    """What ``train``, ``evaluate`` and ``merge`` return.

    Attributes:
        metrics: The final metrics (``train_*`` and ``eval_*``), as the run's ``*_results.json`` hold them.
        output_dir: Where the model (``train``, ``merge``) or the metrics (``evaluate``) were saved.
    """

    metrics: dict[str, Any]
    output_dir: str


def _parse(prog: str, function: str, values: dict[str, Any]) -> Any:
    """The parsed flags of ``values``, converted and checked as the command line's (unknown keywords first)."""
    from vlfit.commands import evaluate, train
    from vlfit.commands.parsing import ParsedArguments

    parser = evaluate.parser() if prog == "vlfit eval" else train.parser_for(prog)
    known = parser.keyword_names()
    if set(values) - known:
        raise unknown_keywords(function, set(values) - known, known)
    if prog == "vlfit eval":
        return evaluate.parse_values(values)
    parsed, given = parser.parse_values(values)
    return ParsedArguments(*parsed, given=given)


@python_api(flags=True)
def train(**flags: Any) -> RunResult:
    """Fine-tune as ``vlfit train`` does, with its flags as keyword arguments; returns the metrics and the folder.

    Example: ``vlfit.train(model_preset="clip-tiny", dataset_name="data/", output_dir="runs/x", max_steps=10)``.
    """
    from vlfit.commands.train import train_parsed

    args = _parse("vlfit train", "train", flags)
    call = ", ".join(f"{name}={value!r}" for name, value in flags.items())
    metrics = train_parsed(args, command_line=f"vlfit.train({call})")
    return RunResult(metrics, args.training.output_dir)


@python_api(flags=True)
def evaluate(**flags: Any) -> RunResult:
    """Evaluate as ``vlfit eval`` does (recall@1/5/10 both ways, matching accuracy) with its flags as keyword
    arguments; the metrics are also written to ``output_dir`` (default: the model folder) as ``eval_results.json``."""
    from vlfit.commands.evaluate import evaluate_parsed

    args = _parse("vlfit eval", "evaluate", flags)
    metrics = evaluate_parsed(args)
    return RunResult(metrics, args.training.output_dir)


@python_api(flags=True)
def merge(**flags: Any) -> RunResult:
    """Merge fine-tuned runs of one base as ``vlfit merge`` does, with its flags as keyword arguments: ``method=``
    ``wise``, ``uniform``, ``greedy`` or ``stock``; returns the merged model's held-out metrics (empty without data)
    and its folder, a run every door loads.

    Example: ``vlfit.merge(method="greedy", runs=["runs/a", "runs/b"], dataset_name="data/", output_dir="runs/soup")``.
    """
    from vlfit.commands import merge as merge_command

    known = merge_command.parser().keyword_names()
    if set(flags) - known:
        raise unknown_keywords("merge", set(flags) - known, known)
    parsed = merge_command.parse_values(flags)
    call = ", ".join(f"{name}={value!r}" for name, value in flags.items())
    result = merge_command.merge_parsed(parsed, command_line=f"vlfit.merge({call})")
    return RunResult(result.metrics, result.output_dir)
