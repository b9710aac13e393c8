"""``vlfit train``: fine-tune, with every flag of ``vlfit.arguments``' dataclasses (HfArgumentParser).

run_bridgetower.py command lines parse unchanged: its model-loading flags (``--config_name``,
``--use_fast_tokenizer``, ``--trust_remote_code``) are ``ModelArguments`` and its Gaudi-only flags are accepted,
each noted in one log line (``vlfit.compat_flags``).
"""

from __future__ import annotations

import logging
import shlex
import sys
from typing import Any

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.commands.parsing import CommandParser, ParsedArguments, is_flags_file, load_flags_file
from vlfit.compat_flags import log_compat_flags
from vlfit.errors import ConfigError
from vlfit.logs import quiet_replicas
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.output_dir import (
    completed_at_step,
    resolve_output_dir,
    run_flags,
    saved_results,
    write_run_flags,
)
from vlfit.training.preemption import TrainingPreempted
from vlfit.training.run import run, setup_run

logger = logging.getLogger(__name__)


def parser_for(prog: str) -> CommandParser:
    """The parser of ``vlfit train`` (and of the commands that take its flags, under their own name)."""
    return CommandParser((ModelArguments, DataArguments, VlfitTrainingArguments), prog=prog)


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
    auto = False
    if is_flags_file(argv):
        values = load_flags_file(argv[0])
        auto = allow_auto_workers and values.get("dataloader_num_workers") == "auto"
        if auto:
            values = {**values, "dataloader_num_workers": 0}
        parsed, given = parser_for(prog).parse_values(values)
        return ParsedArguments(*parsed, given=given, auto_workers=auto)
    if allow_auto_workers and any(arg.endswith("auto") for arg in argv):
        from vlfit.bench.auto import take_auto_workers  # the bench's modules: only when asked for

        argv, auto = take_auto_workers(argv)  # type: ignore[assignment]
    parsed, given = parser_for(prog).parse(argv)  # a bad flag stops here, in one line
    return ParsedArguments(*parsed, given=given, auto_workers=auto)


def note_compat_flags(args: ParsedArguments) -> list[str]:
    """Log one line per run_bridgetower.py flag given, saying what vlfit does with it (on the logging process).

    Returns:
        The lines logged.
    """
    quiet_replicas(args.training.get_process_log_level(), args.training.should_log)
    if not args.training.should_log:
        return []
    return log_compat_flags(args.given, args.model, args.data, args.training)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit train``; ``argv`` ``None`` reads ``sys.argv[1:]``.

    Returns 0, or ``128 + signal`` (143 for SIGTERM, 130 for SIGINT) when a signal stopped training after saving
    a checkpoint, as a shell reports a process killed by that signal: schedulers then see the job as interrupted.
    """
    args = parse_arguments(argv, allow_auto_workers=True)
    command_line = shlex.join(["vlfit", "train", *(sys.argv[1:] if argv is None else argv)])
    try:
        results = train_parsed(args, command_line=command_line)
    except TrainingPreempted as stop:
        print(f"vlfit train: {stop}", file=sys.stderr)
        return stop.exit_code
    if args.training.should_log:  # the metrics were printed once, as a table, by the run
        print(f"vlfit train: model saved to {args.training.output_dir} ({len(results)} metrics in *_results.json)")
    return 0


def train_parsed(args: ParsedArguments, command_line: str | None = None) -> dict[str, Any]:
    """Train with parsed flags (``vlfit train`` and ``vlfit.train``); returns the final metrics.

    ``command_line`` (how the run was started) goes into the model card.

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
        overwrite=training_args.overwrite_output_dir,
        resume_from_checkpoint=training_args.resume_from_checkpoint,
        main_process=training_args.process_index == 0,
    )
    done = completed_at_step(
        training_args.output_dir,
        training_args.resume_from_checkpoint,
        max_steps=training_args.max_steps,
        num_train_epochs=training_args.num_train_epochs,
        overwrite=training_args.overwrite_output_dir,
    )
    if done is not None:  # a rerun of a finished run: nothing to train, nothing to write
        logger.warning(
            "%s: already complete at step %d; nothing trained or written (--overwrite_output_dir trains it again, "
            "vlfit eval evaluates it)",
            training_args.output_dir,
            done,
        )
        return saved_results(training_args.output_dir)
    setup = setup_run(model_args, data_args, training_args)  # data, tokenizer and pipeline, made once
    if args.auto_workers and setup.train_stream is not None:
        raise ConfigError(
            "--dataloader_num_workers auto probes a map-style training split; a streamed one resumes only with the "
            "worker count it was saved with: give a number"
        )
    if args.auto_workers:  # parsed as 0; a short probe picks the count
        from vlfit.bench.auto import probe_num_workers

        training_args.dataloader_num_workers = probe_num_workers(
            setup.train_source,
            setup.spec,
            model_args,
            training_args,
            decode_on_device=setup.pipeline.options.decode_on_device,
            image_pipeline=data_args.image_pipeline,
        )
    if training_args.process_index == 0:
        write_run_flags(training_args.output_dir, flags, args.given)
    return run(model_args, data_args, training_args, setup=setup, command_line=command_line)
