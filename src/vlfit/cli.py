"""The ``vlfit`` command: dispatches ``vlfit <command> [flags]`` to one module per command.

A user mistake (a missing column, a path that does not exist, an unknown preset, a batch size of 0, a bad sample)
is a ``vlfit.errors.UserError`` wherever it was raised (a DataLoader worker re-raises it with its type): it ends as
one line on stderr, ``vlfit <command>: error: <message>``, with exit code 2, as argparse reports a bad flag;
``--debug`` anywhere on the command line shows its traceback instead. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-data": ("vlfit.commands.make_data", "write a synthetic New-Yorker-like captioned dataset"),
    "train": ("vlfit.commands.train", "fine-tune BridgeTower, CLIP or SigLIP (every TrainingArguments flag works)"),
    "prepare": ("vlfit.commands.prepare", "re-encode images at training resolution into parquet shards (resumable)"),
    "filter": ("vlfit.commands.filter", "score each image-text pair with a model; write the splits without the worst"),
    "mine": ("vlfit.commands.mine", "a copy of a split with each caption's hardest negatives mined with a model"),
    "eval": ("vlfit.commands.evaluate", "text<->image recall@1/5/10 and matching accuracy on a split"),
    "demo": ("vlfit.commands.demo", "make data, fine-tune the small-p8 preset on the CPU, evaluate, summarize"),
    "bench": ("vlfit.commands.bench", "input-pipeline throughput sweep: the bottleneck and the settings to use"),
    "export": ("vlfit.commands.export", "a checkpoint's two towers as ONNX/OpenVINO graphs (fp32, INT8), checked"),
    "retrieve": (
        "vlfit.commands.retrieve",
        "image index: built (retrieve index), searched (query), pushed (push), checked (verify)",
    ),
    "serve": ("vlfit.commands.serve", "an index as an HTTP search API with a web page (FastAPI on uvicorn)"),
    "search": ("vlfit.commands.search", "hyperparameter search over train runs (Optuna; resumable, pruned)"),
    "merge-lora": ("vlfit.commands.merge_lora", "a plain checkpoint from a run's LoRA adapters"),
    "fewshot": ("vlfit.commands.fewshot", "zero-shot, linear probe and SetFit compared at 1-16 labelled images/class"),
    "classify": ("vlfit.commands.classify", "label images with a classifier vlfit fewshot saved"),
    "merge": ("vlfit.commands.merge", "one model from fine-tuned runs: WiSE-FT, uniform or greedy soup, Model Stock"),
    "wise-ft": ("vlfit.commands.wise_ft", "merge --method wise along a curve of alphas (WiSE-FT): curve and pick"),
    "vqa": ("vlfit.commands.vqa", "answer questions about an image with a model vlfit train --task vqa saved"),
}
# Commands with subcommands, each with flags of its own.
SUBCOMMANDS = {"retrieve": ("index", "query", "push", "verify")}

DEBUG_FLAG = "--debug"
LOG_LEVEL_FLAG = "--log_level"
# Exit code of a user mistake: argparse's, so scripts see the same code for a bad flag and a bad value.
USAGE_ERROR_EXIT_CODE = 2


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: vlfit <command> [flags] [--debug]   (vlfit <command> --help for its flags; vlfit --version)",
        "",
        "commands:",
        *(f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()),
        "",
        f"{DEBUG_FLAG}: show the Python traceback of an error instead of one line",
        f"{LOG_LEVEL_FLAG} debug|info|warning|error: what vlfit logs to stderr (default: info)",
    ]
    return "\n".join(lines)


def take_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """Remove vlfit's ``--debug`` from ``argv``, wherever it is.

    ``TrainingArguments`` has a ``--debug`` too, which always takes a value (``--debug underflow_overflow``): a
    ``--debug`` after the command name followed by such a value is left for it.

    Returns:
        The arguments without vlfit's ``--debug``, and whether it was there.
    """
    kept: list[str] = []
    found = False
    for i, arg in enumerate(argv):
        if arg == DEBUG_FLAG and not (i > 0 and i + 1 < len(argv) and _is_training_debug_value(argv[i + 1])):
            found = True
        else:
            kept.append(arg)
    return kept, found


def take_log_level(argv: list[str]) -> tuple[list[str], str]:
    """Remove ``--log_level LEVEL`` (or ``--log_level=LEVEL``) from ``argv``, wherever it is.

    Returns:
        The arguments without it, and the level (``info`` when not given).

    Raises:
        SystemExit: for a level that is not one of ``vlfit.logs.LOG_LEVELS`` (exit code 2, as argparse).
    """
    from vlfit.logs import LOG_LEVELS

    kept: list[str] = []
    level = "info"
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == LOG_LEVEL_FLAG and i + 1 < len(argv):
            level, i = argv[i + 1], i + 2
            continue
        if arg.startswith(LOG_LEVEL_FLAG + "="):
            level = arg.split("=", 1)[1]
        else:
            kept.append(arg)
        i += 1
    if level not in LOG_LEVELS:
        print(f"vlfit: error: {LOG_LEVEL_FLAG} {level!r}: choose one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR_EXIT_CODE)
    return kept, level


def _is_training_debug_value(arg: str) -> bool:
    if not arg or arg.startswith("-"):
        return False
    from transformers.debug_utils import DebugOption  # only here: importing transformers takes seconds

    options = {option.value for option in DebugOption}
    return all(word in options for word in arg.split())


def error_line(err: BaseException) -> str:
    """The message of ``err`` on one line.

    An exception re-raised from a DataLoader worker carries the worker's whole traceback: its last line holds the
    original message.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    # torch re-raises "Caught <type> in DataLoader worker process N.\nOriginal Traceback ...\n<module>.<type>: <msg>".
    if len(lines) > 2 and lines[0].startswith("Caught ") and lines[1].startswith("Original Traceback"):
        name = re.escape(type(err).__name__)
        return re.sub(rf"^(?:[\w.]+\.)?{name}: ", "", lines[-1])
    return " ".join(lines)


def _stop_loader_workers(error: BaseException) -> None:
    """Stop the loader workers of whatever loop ``error`` ended, now rather than at garbage collection
    (``vlfit.data.loader_workers``); nothing to do where torch was never imported."""
    if "torch" in sys.modules:
        from vlfit.data.loader_workers import stop_loader_workers

        stop_loader_workers(error.__traceback__)


def main(argv: list[str] | None = None, *, answer_from_index: bool = True) -> int:
    """Run ``vlfit <command>``; returns the process exit code.

    Args:
        argv: The arguments (``None``: ``sys.argv[1:]``).
        answer_from_index: Answer ``--help`` and a mistyped flag from the recorded flag index, before the command
            is imported (``vlfit.flag_index``); False asks the command's own parser (what the index and
            ``docs/cli.md`` are made from).
    """
    argv, debug = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from vlfit.version import __version__

        print(f"vlfit {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"vlfit: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    from vlfit.errors import NO_SPACE_ERRNOS, UserError, cli_wording, disk_full_error
    from vlfit.logs import configure_logging, end_progress_bars

    rest, log_level = take_log_level(rest)
    from vlfit.extras import COMMAND_EXTRAS, require_extra
    from vlfit.flag_index import answer_early

    try:
        if command in COMMAND_EXTRAS:
            require_extra(COMMAND_EXTRAS[command], f"vlfit {command}")
        # --help, a typo or a missing data file: answered before any heavy import (logging's set-up imports
        # transformers).
        early = answer_early(command, rest, SUBCOMMANDS.get(command, ())) if answer_from_index else None
        if early is not None:
            return early
        configure_logging(log_level)  # the one place logging is configured
        module = importlib.import_module(COMMANDS[command][0])
        with cli_wording():  # the API functions a command calls keep its flags' names in their messages
            code = int(module.main(rest) or 0)
    except BaseException as err:
        _stop_loader_workers(err)
        if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS and not isinstance(err, UserError):
            err = disk_full_error(err, os.path.dirname(err.filename or "") or os.getcwd())  # no traceback for it
        if debug or not isinstance(err, UserError):
            raise
        end_progress_bars()
        print(f"vlfit {command}: error: {error_line(err)}", file=sys.stderr)
        return USAGE_ERROR_EXIT_CODE
    # A process group left to interpreter exit can abort the process after its work is done (gloo's worker threads
    # outlive the interpreter: SIGABRT, pytorch#190489). Only after a normal return: a process that raised may
    # have peers still inside a collective, which destroying the group could hang.
    dist = sys.modules.get("torch.distributed")  # not imported: no process group to close
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
