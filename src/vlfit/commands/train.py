"""``vlfit train``: fine-tune with HfArgumentParser((ModelArguments, DataArguments, VlfitTrainingArguments))."""

from __future__ import annotations

import json
import os
import sys

from transformers import HfArgumentParser

from vlfit.arguments import DataArguments, ModelArguments, VlfitTrainingArguments
from vlfit.bench.auto import probe_num_workers, take_auto_workers
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import run


def parse_arguments(
    argv: list[str] | None, prog: str = "vlfit train"
) -> tuple[ModelArguments, DataArguments, VlfitTrainingArguments]:
    """Parse flags, or a single ``.json``/``.yaml``/``.yml`` file holding them all."""
    parser = HfArgumentParser((ModelArguments, DataArguments, VlfitTrainingArguments), prog=prog)
    if argv is not None and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        path = os.path.abspath(argv[0])
        if path.endswith(".json"):
            return parser.parse_json_file(json_file=path)  # type: ignore[return-value]
        return parser.parse_yaml_file(yaml_file=path)  # type: ignore[return-value]
    return parser.parse_args_into_dataclasses(args=argv)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit train``.

    Returns 0, or ``128 + signal`` (143 for SIGTERM, 130 for SIGINT) when a signal stopped training after saving
    a checkpoint, as a shell reports a process killed by that signal: schedulers then see the job as interrupted.
    """
    argv, auto_workers = take_auto_workers(argv)  # `--dataloader_num_workers auto`: parse as 0, then probe
    model_args, data_args, training_args = parse_arguments(argv)
    if auto_workers:
        training_args.dataloader_num_workers = probe_num_workers(model_args, data_args, training_args)
    training_args.do_train = True  # `vlfit train` always trains; --do_eval adds an evaluation afterwards
    try:
        results = run(model_args, data_args, training_args)
    except TrainingPreempted as stop:
        print(f"vlfit train: {stop}", file=sys.stderr)
        return stop.exit_code
    if training_args.should_log:
        print(json.dumps({k: v for k, v in results.items() if isinstance(v, (int, float))}, indent=1))
    return 0
