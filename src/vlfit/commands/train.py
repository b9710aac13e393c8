"""``vlfit train``: fine-tune with HfArgumentParser((ModelArguments, DataArguments, VlfitTrainingArguments))."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import yaml
from transformers import HfArgumentParser

from vlfit.arguments import DataArguments, ModelArguments, VlfitTrainingArguments
from vlfit.bench.auto import probe_num_workers, take_auto_workers
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import run


def is_flags_file(argv: list[str] | None) -> bool:
    """True when the arguments are one ``.json``/``.yaml``/``.yml`` file holding every flag."""
    return argv is not None and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))


def load_flags_file(path: str) -> dict[str, Any]:
    """The flags a ``.json`` or ``.yaml``/``.yml`` file holds, as ``{flag name: value}``."""
    is_json = path.endswith(".json")
    with open(os.path.abspath(path), encoding="utf-8") as f:
        try:
            values = json.load(f) if is_json else yaml.safe_load(f)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ValueError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {err}") from err
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values, got {type(values).__name__}")
    return values


def _parser(prog: str) -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, DataArguments, VlfitTrainingArguments), prog=prog)


def parse_arguments(
    argv: list[str] | None, prog: str = "vlfit train"
) -> tuple[ModelArguments, DataArguments, VlfitTrainingArguments]:
    """Parse flags, or a single ``.json``/``.yaml``/``.yml`` file holding them all."""
    if is_flags_file(argv):
        return _parser(prog).parse_dict(load_flags_file(argv[0]))  # type: ignore[index, return-value]
    return _parser(prog).parse_args_into_dataclasses(args=argv)  # type: ignore[return-value]


def parse_train_arguments(
    argv: list[str] | None,
) -> tuple[ModelArguments, DataArguments, VlfitTrainingArguments, bool]:
    """``parse_arguments``, also accepting ``dataloader_num_workers`` ``auto`` (on the command line or in the file).

    Returns:
        The three argument sets (``auto`` parsed as 0) and whether ``auto`` was asked for.
    """
    if is_flags_file(argv):
        values = load_flags_file(argv[0])  # type: ignore[index]
        auto = values.get("dataloader_num_workers") == "auto"
        if auto:
            values = {**values, "dataloader_num_workers": 0}
        return (*_parser("vlfit train").parse_dict(values), auto)  # type: ignore[return-value]
    argv, auto = take_auto_workers(argv)
    return (*parse_arguments(argv), auto)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit train``.

    Returns 0, or ``128 + signal`` (143 for SIGTERM, 130 for SIGINT) when a signal stopped training after saving
    a checkpoint, as a shell reports a process killed by that signal: schedulers then see the job as interrupted.
    """
    # `--dataloader_num_workers auto`: parsed as 0, then a short probe picks the count.
    model_args, data_args, training_args, auto_workers = parse_train_arguments(argv)
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
