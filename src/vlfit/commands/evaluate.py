"""``vlfit eval``: recall@1/5/10 both ways and matching accuracy of a model on one split."""

from __future__ import annotations

import json
from typing import Any

from vlfit.commands.train import ParsedArguments, note_compat_flags, parse_arguments
from vlfit.training.run import run


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit eval``: the same flags as ``vlfit train``; ``--eval_split`` picks the split.

    Metrics are written to ``--output_dir`` (default: the model folder) as ``eval_results.json``. ``argv`` ``None``
    reads ``sys.argv[1:]``.
    """
    args = parse_arguments(argv, prog="vlfit eval")
    results = evaluate_parsed(args)
    if args.training.should_log:
        print(json.dumps(results, indent=1))
    return 0


def evaluate_parsed(args: ParsedArguments) -> dict[str, Any]:
    """Evaluate with parsed flags (``vlfit eval`` and ``vlfit.evaluate``); returns the metrics."""
    model_args, data_args, training_args = args.model, args.data, args.training
    if "output_dir" not in args.given and model_args.model_name_or_path:
        training_args.output_dir = model_args.model_name_or_path
    note_compat_flags(args)
    training_args.do_train, training_args.do_eval = False, True
    return run(model_args, data_args, training_args)
