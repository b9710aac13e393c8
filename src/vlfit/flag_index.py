"""Every command's flags and ``--help``, written down ahead of time (``flag_index.json``), so that ``vlfit``
answers a typo or ``--help`` before it imports torch, transformers or datasets (seconds of CPU).

``vlfit <command> --help`` prints the recorded help; a flag no parser of the command takes stops in one line with
the closest known flags, as the parser itself would, and so do a value of the wrong type or not among the flag's
choices (a parser rebuilt from each flag's recorded type, choices and ``nargs``: argparse's own words), a size out
of its range (``vlfit.arguments.sizes``), a model flag naming a folder of something else or a local path with
nothing there, a local data file that does not exist (``--train_file``...), an ``--index`` that is no index folder,
an ``--output_dir`` that names a file or a folder the command would not write into (``vlfit.output_folders``) and a
rule between flags that the values alone decide (``vlfit.arguments.flag_rules``, for the commands in
``RULE_RUNS``), before the command's module is imported. Everything else is the command's own parser's and checks'
to refuse (they check all of it again: the index only answers sooner).

The file is made from the parsers themselves (each ``CommandParser`` records its option strings as it prints its
help, ``vlfit.commands.cli_reference.flag_index``), with a fingerprint of the files that define the flags: an index
made from other sources than the installed ones is not used (the parsers answer). Regenerate it with the
command-line reference after changing a flag (``make docs``; a test fails while it is stale)::

    python -m vlfit.commands.cli_reference --flag-index
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import glob
import hashlib
import json
import os
import sys
from collections.abc import Collection, Iterable
from functools import cache
from typing import Any, NoReturn

from vlfit.errors import UserError

INDEX_FILE = os.path.join(os.path.dirname(__file__), "flag_index.json")
REGENERATE = "python -m vlfit.commands.cli_reference --flag-index"
HELP_FLAGS = ("-h", "--help")
# The files that define the commands' flags, relative to the package (what ``source_fingerprint`` hashes).
FLAG_SOURCES = ("arguments/*.py", "commands/*.py", "compat_flags.py", "flags.py", "search/study.py",
                "serve/limits.py", "training/arguments.py")  # fmt: skip
# The local data files a command reads (``vlfit.arguments.data``): one that names no file is refused before the
# imports, naming the flag.
DATA_FILE_FLAGS = ("--train_file", "--validation_file", "--test_file")
# The flags that name a model to load, by field name: one that names a folder of something else (images, data, an
# index, a run without its model) or a local path with nothing there is refused before the imports.
MODEL_FLAGS = ("model_name_or_path", "runs", "base", "zeroshot_model", "finetuned_model",
               "vision_model_name_or_path", "text_model_name_or_path")  # fmt: skip
# The index folder a command reads (``vlfit retrieve query``, ``push``, ``verify``, ``vlfit serve``).
INDEX_FLAG = "--index"
AUTO_WORKERS_FLAG = "dataloader_num_workers"  # vlfit train takes `auto` (a probe of worker counts) for it
# The commands whose runs check the rules between flags (``vlfit.arguments.flag_rules``), with the values they set
# themselves: ``vlfit train`` always trains.
RULE_RUNS: dict[str, dict[str, Any]] = {
    "vlfit train": {"do_train": True},
    "vlfit search": {"do_train": True},
    "vlfit eval": {},
}


def closest_flags(flag: str, known: Iterable[str]) -> list[str]:
    """The known flags closest to a mistyped one (at most two; their underscore spelling)."""
    return difflib.get_close_matches(flag, sorted(known), n=2, cutoff=0.75)


def unrecognized_message(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``unrecognized arguments: --learning_rat (did you mean --learning_rate?)``: each unknown flag (``--name``
    or ``--name=value``) with the closest known ones, then the other unknown words."""
    unknown = list(unknown)
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    others = [arg for arg in unknown if not arg.startswith("-")]
    underscored = [flag for flag in known if "-" not in flag.lstrip("-")]  # --learning-rate is the same flag
    parts = []
    for flag in flags:
        close = closest_flags(flag, underscored)
        parts.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    if others and not flags:
        parts.append(" ".join(others))
    return f"unrecognized arguments: {', '.join(parts)}"


def source_fingerprint() -> str:
    """SHA-256 of the files that define the flags (``FLAG_SOURCES``) and of transformers' version (its
    ``TrainingArguments`` are ``vlfit train``'s flags too): an index made from other sources is not used."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    root = os.path.dirname(__file__)
    for pattern in FLAG_SOURCES:
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            with open(path, "rb") as f:
                digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    with contextlib.suppress(PackageNotFoundError):
        digest.update(version("transformers").encode())
    return digest.hexdigest()


@cache
def _index() -> dict[str, Any]:
    """The recorded commands, or none when there is no index (a source tree before ``make docs``) or it was made
    from other sources than these (a flag added since: the parsers answer, as ever)."""
    try:
        with open(INDEX_FILE, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return {}
    return index.get("commands", {}) if index.get("fingerprint") == source_fingerprint() else {}


def answer_early(command: str, argv: list[str], subcommands: Iterable[str] = ()) -> int | None:
    """The exit code of ``vlfit <command> argv`` when it can be answered from the index alone (``--help``: 0, an
    unknown flag: 2, with the line printed), else None (the command runs).

    Args:
        command: The command's name.
        argv: Its arguments.
        subcommands: The command's subcommands (``retrieve``: ``index``, ``query``, ``verify``), the first argument.
    """
    words = [command]
    if argv and argv[0] in subcommands:
        words.append(argv[0])
        argv = argv[1:]
    entry = _index().get("vlfit " + " ".join(words))
    if entry is None or (len(argv) == 1 and not argv[0].startswith("-")):  # none recorded, or a flags file
        return None
    flags = argv[: argv.index("--")] if "--" in argv else argv
    if any(arg in HELP_FLAGS for arg in flags):
        sys.stdout.write(entry["help"])
        return 0
    known = set(entry["flags"])
    if not known:  # a command whose parser records none: its own parser answers
        return None
    unknown = [arg for arg in flags if arg.startswith("--") and arg.split("=", 1)[0] not in known]
    prog = "vlfit " + " ".join(words)
    if unknown:
        print(f"{prog}: error: {unrecognized_message(unknown, known)}; see {prog} --help", file=sys.stderr)
        return 2
    try:
        given = recorded_parser(prog, entry.get("actions", ())).parse_known_args(_judged(flags))[0]
    except _Refused as refusal:  # a value of the wrong type, or not one of the flag's choices: argparse's line
        print(f"{prog}: error: {refusal}; see {prog} --help", file=sys.stderr)
        raise SystemExit(2) from None  # as the command's own parser stops (CommandParser.error)
    try:
        check_early(prog, entry, flags, vars(given))
    except UserError as error:  # the command's own line, in its own words (vlfit retrieve: ...)
        print(f"vlfit {command}: error: {error}", file=sys.stderr)
        return 2
    return None


def check_early(prog: str, entry: dict[str, Any], argv: list[str], given: dict[str, Any]) -> None:
    """Every check of ``prog``'s flags that needs neither data nor a model, on the values ``given`` (by field name,
    as the recorded parser converted them) of ``argv``: sizes, model flags, ``--output_dir``, data files,
    ``--index`` and the rules between flags.

    Raises:
        UserError: the command's own line (with a ``prog`` attribute where the command says other words).
    """
    known = set(entry["flags"])
    check_sizes(given)
    check_model_flags(given, _typed_flags(entry, argv))
    if "--output_dir" in known:
        check_output_folder(prog, argv, _model_paths(given))
    if known & set(DATA_FILE_FLAGS):
        check_data_files(argv)
    if INDEX_FLAG in known:
        check_index_flag(argv)
    if prog in RULE_RUNS:
        check_flag_rules(prog, entry, given)


def _judged(flags: list[str]) -> list[str]:
    """The flags whose values the recorded parser judges: ``--dataloader_num_workers auto`` (a probe ``vlfit
    train`` runs, not an int) is left to the command's own parser."""
    kept: list[str] = []
    skip = False
    for position, arg in enumerate(flags):
        if skip:
            skip = False
            continue
        if arg == f"--{AUTO_WORKERS_FLAG}=auto" or (
            arg == f"--{AUTO_WORKERS_FLAG}" and flags[position + 1 : position + 2] == ["auto"]
        ):
            skip = arg == f"--{AUTO_WORKERS_FLAG}"
            continue
        kept.append(arg)
    return kept


class _Refused(Exception):
    """A value the recorded parser refuses; its message is argparse's."""


class _RecordedParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Refused(message)


def recorded_parser(prog: str, actions: Iterable[dict[str, Any]]) -> argparse.ArgumentParser:
    """A parser of the recorded flags (``cli_reference.recorded_actions``) that converts and checks each value given
    as the command's own parser does (argparse's int and float, transformers' bool, the choices), with argparse's
    words, and leaves out every flag not given."""
    parser = _RecordedParser(prog=prog, add_help=False, allow_abbrev=False)
    for action in actions:
        kwargs: dict[str, Any] = {"dest": action["dest"], "default": argparse.SUPPRESS}
        if action["nargs"] == 0:
            kwargs.update(action="store_const", const=action.get("const"))
        else:
            kwargs.update(nargs=action["nargs"], type=_converter(action), choices=action.get("choices"))
            if action["nargs"] == "?":
                kwargs["const"] = action.get("const")
        parser.add_argument(*action["flags"], **kwargs)
    return parser


def _converter(action: dict[str, Any]) -> Any:
    """The recorded flag's conversion of a string (None: kept as given)."""
    kind = action.get("type")
    if kind in ("int", "float"):
        return int if kind == "int" else float
    if kind == "bool":
        words, refusal = action["words"], action.get("refusal", "{value}")

        def string_to_bool(value: str) -> bool:  # argparse's line names the type function: transformers' name
            if value.lower() not in words:
                raise argparse.ArgumentTypeError(refusal.replace("{value}", value))
            return words[value.lower()]

        return string_to_bool
    if action.get("choices") is not None:
        by_text = {str(choice): choice for choice in action["choices"]}
        return lambda value: by_text.get(value, value)
    return None


def check_flag_rules(prog: str, entry: dict[str, Any], given: dict[str, Any]) -> None:
    """Refuse flags ``given`` that break a rule between flags (``vlfit.arguments.flag_rules``) that their values
    alone decide (the rules are checked again on the built arguments).

    Raises:
        ConfigError: the rule's line.
    """
    from vlfit.arguments.flag_rules import FlagValues, refuse_flags  # light: no torch

    defaults = {action["dest"]: action["default"] for action in entry["actions"] if "default" in action}
    values = {**defaults, **given}
    model = values.get("model_name_or_path")
    if model and os.path.isdir(model) and "task" not in given:
        values.pop("task", None)  # a folder may make the run's task (a VQA model's): decided once it is read
    refuse_flags(FlagValues(values, defaults, **RULE_RUNS[prog]))


def check_sizes(given: dict[str, Any]) -> None:
    """Refuse a size flag given out of its range (``vlfit.arguments.sizes``), naming the flag and the range."""
    from vlfit.arguments import sizes  # light: no torch

    sizes.check_sizes(given)


def check_model_flags(given: dict[str, Any], typed: dict[str, str]) -> None:
    """Refuse, in the line the command itself says (``vlfit.models.reference.parse_model_reference``), a model
    flag (``MODEL_FLAGS``; ``typed``: the option the user wrote for each) that names a folder holding no model
    (images, data, an index ...) or a local path with nothing there. A hub id, a preset's name, an export or
    adapters are left to the command."""
    from vlfit.models.presets import list_presets  # light: no torch
    from vlfit.models.reference import LOADABLE, parse_model_reference

    for name in MODEL_FLAGS:
        values = given.get(name)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str) and value and (value not in list_presets() or os.path.exists(value)):
                parse_model_reference(value, flag=typed.get(name, f"--{name}"), kinds=(*LOADABLE, "export"))


def _typed_flags(entry: dict[str, Any], argv: list[str]) -> dict[str, str]:
    """The option the user wrote for each flag given (``--model`` for ``model_name_or_path``), by field name."""
    typed = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return {
        action["dest"]: option for action in entry.get("actions", ()) for option in action["flags"] if option in typed
    }


def check_data_files(argv: list[str]) -> None:
    """Refuse a local data file flag (``DATA_FILE_FLAGS``) that names no file, naming the flag. A stream spec
    (URLs, ``::``-joined sources) is left to the command."""
    from vlfit.data.file_patterns import is_stream_spec, resolve_files  # light: no torch
    from vlfit.errors import MissingFileError

    for flag, value in _flag_values(argv, DATA_FILE_FLAGS):
        if value and not is_stream_spec(value):
            try:
                resolve_files(value)
            except MissingFileError as error:
                raise MissingFileError(f"{flag} {value}: {error}") from None


def check_index_flag(argv: list[str]) -> None:
    """Refuse, in the line the command itself says (``vlfit.models.reference.check_index_folder``), an ``--index``
    that names no index folder: nothing there, a file, or another kind of folder. A pushed index's address
    (``qdrant:...``) is left to the command."""
    from vlfit.index.push.base import is_target_uri  # light: numpy, no torch
    from vlfit.models.reference import check_index_folder

    for _, value in _flag_values(argv, (INDEX_FLAG,)):
        if not is_target_uri(value):
            check_index_folder(value)


def _model_paths(given: dict[str, Any]) -> set[str]:
    """The real paths the model flags given name (``MODEL_FLAGS``)."""
    values = [given.get(name) for name in MODEL_FLAGS]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    return {os.path.realpath(value) for value in flat if value}


def check_output_folder(prog: str, argv: list[str], models: Collection[str] = ()) -> None:
    """Refuse an ``--output_dir`` that names a file (or a path under one), or a folder the command would not write
    into (``vlfit.output_folders``: one that holds what the command did not write). One that is a model the
    command reads (``models``, real paths) is left to the command, which says so in its own words."""
    from vlfit.atomic_files import refuse_file_as_folder  # light: no torch
    from vlfit.output_folders import OUTPUT_FOLDERS

    claim = OUTPUT_FOLDERS.get(prog)
    for flag, value in _flag_values(argv, ("--output_dir",)):
        if os.path.realpath(value) in models:
            continue
        if claim is not None:
            claim.claim(value, flag)
        else:
            refuse_file_as_folder(value, flag)


def _flag_values(argv: list[str], names: Iterable[str]) -> list[tuple[str, str]]:
    """``(flag, value)`` of each of ``names`` given in ``argv`` (``--flag value`` or ``--flag=value``)."""
    found = []
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in names:
            if equals:
                found.append((name, value))
            elif i + 1 < len(argv):
                found.append((name, argv[i + 1]))
    return found
