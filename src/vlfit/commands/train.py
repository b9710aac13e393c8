"""``vlfit train``: fine-tune, with every flag of ``vlfit.arguments``' dataclasses (HfArgumentParser).

run_bridgetower.py command lines parse unchanged: its model-loading flags (``--config_name``,
``--use_fast_tokenizer``, ``--trust_remote_code``) are ``ModelArguments`` and its Gaudi-only flags are accepted,
each noted in one log line (``vlfit.compat_flags``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NamedTuple

import yaml

from vlfit.arguments import DataArguments, ModelArguments, VlfitTrainingArguments
from vlfit.bench.auto import probe_num_workers, take_auto_workers
from vlfit.commands.parsing import CommandParser
from vlfit.compat_flags import log_compat_flags
from vlfit.errors import ConfigError
from vlfit.training.output_dir import resolve_output_dir, run_flags, write_run_flags
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import run, setup_logging, setup_run


class ParsedArguments(NamedTuple):
    """What ``parse_arguments`` returns.

    Attributes:
        model: Which model to fine-tune, and how to load it.
        data: The data and its input pipeline.
        training: Every ``TrainingArguments`` flag and vlfit's own.
        given: Names of the fields the command line or the flags file set, whatever their values (``--no_x`` and
            ``--x False`` set ``x``): what the user asked for, as opposed to defaults.
        auto_workers: ``--dataloader_num_workers auto`` was asked for (then parsed as 0).
    """

    model: ModelArguments
    data: DataArguments
    training: VlfitTrainingArguments
    given: frozenset[str]
    auto_workers: bool = False


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
            raise ConfigError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, got {type(values).__name__}")
    return values


def parser_for(prog: str) -> CommandParser:
    """The parser of ``vlfit train`` (and of the commands that take its flags, under their own name)."""
    return CommandParser((ModelArguments, DataArguments, VlfitTrainingArguments), prog=prog)


def given_fields(argv: list[str], prog: str = "vlfit train") -> frozenset[str]:
    """Names of the fields ``argv`` sets, as argparse reads it (``--flag=value``, ``--no_flag``, abbreviations)."""
    parser = parser_for(prog)
    for action in parser._actions:  # with a SUPPRESS default, argparse leaves a flag not given out of the namespace
        action.default = argparse.SUPPRESS
    namespace, _ = parser.parse_known_args(argv)
    return frozenset(vars(namespace))


def parse_arguments(
    argv: list[str] | None, prog: str = "vlfit train", *, allow_auto_workers: bool = False
) -> ParsedArguments:
    """Parse flags, or a single ``.json``/``.yaml``/``.yml`` file holding them all.

    Args:
        argv: The command's arguments; ``None`` reads ``sys.argv[1:]``.
        prog: The command's name in messages.
        allow_auto_workers: Accept ``dataloader_num_workers`` ``auto`` (on the command line or in the file), parsed
            as 0; ``auto_workers`` then says it was asked for.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_flags_file(argv):
        values = load_flags_file(argv[0])
        auto = allow_auto_workers and values.get("dataloader_num_workers") == "auto"
        if auto:
            values = {**values, "dataloader_num_workers": 0}
        return ParsedArguments(*parser_for(prog).parse_dict(values), given=frozenset(values), auto_workers=auto)
    auto = False
    if allow_auto_workers:
        argv, auto = take_auto_workers(argv)  # type: ignore[assignment]
    parsed = parser_for(prog).parse_args_into_dataclasses(args=argv)  # a bad flag stops here, with the usage
    return ParsedArguments(*parsed, given=given_fields(argv, prog), auto_workers=auto)


def note_compat_flags(args: ParsedArguments) -> list[str]:
    """Log one line per run_bridgetower.py flag given, saying what vlfit does with it (on the logging process).

    Returns:
        The lines logged.
    """
    setup_logging(args.training)
    if not args.training.should_log:
        return []
    return log_compat_flags(args.given, args.model, args.data, args.training)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit train``; ``argv`` ``None`` reads ``sys.argv[1:]``.

    Returns 0, or ``128 + signal`` (143 for SIGTERM, 130 for SIGINT) when a signal stopped training after saving
    a checkpoint, as a shell reports a process killed by that signal: schedulers then see the job as interrupted.
    """
    args = parse_arguments(argv, allow_auto_workers=True)
    try:
        results = train_parsed(args)
    except TrainingPreempted as stop:
        print(f"vlfit train: {stop}", file=sys.stderr)
        return stop.exit_code
    if args.training.should_log:
        print(json.dumps({k: v for k, v in results.items() if isinstance(v, (int, float))}, indent=1))
        print(f"vlfit train: model saved to {args.training.output_dir}")
    return 0


def train_parsed(args: ParsedArguments) -> dict[str, Any]:
    """Train with parsed flags (``vlfit train`` and ``vlfit.train``); returns the final metrics.

    Raises:
        TrainingPreempted: SIGTERM or SIGINT stopped training after saving a checkpoint.
    """
    model_args, data_args, training_args = args.model, args.data, args.training
    note_compat_flags(args)
    training_args.do_train = True  # `vlfit train` always trains; --do_eval adds an evaluation afterwards
    flags = run_flags(model_args, data_args, training_args)
    training_args.resume_from_checkpoint = resolve_output_dir(
        training_args.output_dir,
        flags,
        args.given,
        overwrite=training_args.overwrite_output_dir and training_args.process_index == 0,
        resume_from_checkpoint=training_args.resume_from_checkpoint,
    )
    setup = setup_run(model_args, data_args, training_args)  # data, tokenizer and pipeline, made once
    if args.auto_workers:  # parsed as 0; a short probe picks the count
        training_args.dataloader_num_workers = probe_num_workers(
            setup.train_source,
            setup.blueprint,
            model_args,
            training_args,
            decode_on_device=setup.pipeline.options.decode_on_device,
            image_pipeline=data_args.image_pipeline,
        )
    if training_args.process_index == 0:
        write_run_flags(training_args.output_dir, flags, args.given)
    return run(model_args, data_args, training_args, setup=setup)
