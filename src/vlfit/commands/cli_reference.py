"""The command-line reference, ``docs/cli.md``: every command's ``--help``, as ``vlfit <command> --help`` prints it;
and the flag index (``vlfit/flag_index.json``: each command's help and option strings, what ``vlfit`` answers
``--help`` and typos from before its heavy imports).

Regenerate both after changing a flag (``make docs``; a test fails while either is stale)::

    python -m vlfit.commands.cli_reference > docs/cli.md
    python -m vlfit.commands.cli_reference --flag-index
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any

REGENERATE = "python -m vlfit.commands.cli_reference > docs/cli.md"
# argparse wraps help to the terminal's width: fixed, so the page does not depend on who generated it.
HELP_COLUMNS = "120"


def command_lines() -> list[list[str]]:
    """The command lines documented: ``[command]`` or ``[command, subcommand]``, in ``vlfit --help``'s order."""
    from vlfit.cli import COMMANDS, SUBCOMMANDS

    lines: list[list[str]] = []
    for command in COMMANDS:
        lines.extend([[command, sub] for sub in SUBCOMMANDS[command]] if command in SUBCOMMANDS else [[command]])
    return lines


def help_text(words: list[str]) -> str:
    """What ``vlfit <words> --help`` prints, at a fixed width."""
    from vlfit.cli import main

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        quiet = contextlib.redirect_stderr(io.StringIO())
        with contextlib.redirect_stdout(out), quiet, contextlib.suppress(SystemExit):  # argparse exits after the help
            main([*words, "--help"], answer_from_index=False)  # the parser's own help, not the recorded one
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip() + "\n"


def render() -> str:
    """The whole of ``docs/cli.md``."""
    from vlfit.cli import COMMANDS, usage

    entries = command_lines()
    parts = [
        "# Command-line reference\n",
        f"Generated from the flags' own help (`{REGENERATE}`); do not edit by hand. "
        "Every command also takes `--debug` (the traceback instead of a one-line error) and `--log_level`.\n",
        "```\n" + usage() + "\n```\n",
        "Commands: " + ", ".join(f"[`vlfit {' '.join(words)}`](#{_anchor(words)})" for words in entries) + ".\n",
    ]
    for words in entries:
        title = f"vlfit {' '.join(words)}"
        summary = COMMANDS[words[0]][1]
        parts.append(f"## {title}\n\n{summary}.\n\n```\n{help_text(words)}```\n")
    return "\n".join(parts)


def _anchor(words: list[str]) -> str:
    # GitHub's heading anchor of "## vlfit <words>": lower case, spaces to hyphens.
    return "-".join(["vlfit", *words]).lower()


def flag_index() -> dict[str, Any]:
    """Each command line's help (as ``docs/cli.md`` holds it), the option strings its parser takes and how each
    flag parses (``recorded_actions``), recorded by ``CommandParser.print_help``."""
    from vlfit.commands import parsing

    index: dict[str, Any] = {}
    for words in command_lines():
        prog = "vlfit " + " ".join(words)
        parsing.HELP_PARSER_RECORD.clear()
        text = help_text(words)
        parser = parsing.HELP_PARSER_RECORD.get(prog)
        flags = sorted(parser._option_string_actions) if parser is not None else []
        actions = recorded_actions(parser) if parser is not None else []
        index[prog] = {"help": text, "flags": flags, "actions": actions}
    return index


# The checks of a value that the flag index can repeat without the parser: argparse's own conversions.
_RECORDED_TYPES = {int: "int", float: "float"}
# The strings transformers' string_to_bool takes (it raises for any other; its line is recorded with the flag).
_BOOL_WORDS = ("yes", "true", "t", "y", "1", "no", "false", "f", "n", "0")


def recorded_actions(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """How each flag of ``parser`` parses, as plain JSON: its option strings, field, ``nargs``, type (``int``,
    ``float``, ``bool`` with the words it takes and its refusal, or none: any string), choices and default (when
    JSON holds them; ``vlfit.flag_index`` rebuilds the parser's checks of a value from this)."""
    recorded = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        entry: dict[str, Any] = {"flags": list(action.option_strings), "dest": action.dest, "nargs": action.nargs}
        if action.nargs == 0:
            entry["const"] = _plain(action.const)
        elif action.type in _RECORDED_TYPES:
            entry["type"] = _RECORDED_TYPES[action.type]
        elif getattr(action.type, "__name__", "") == "string_to_bool":
            entry["type"] = "bool"
            entry["words"] = {word: action.type(word) for word in _BOOL_WORDS}
            try:
                action.type("\0")
            except argparse.ArgumentTypeError as refusal:
                entry["refusal"] = str(refusal).replace("\0", "{value}")
        if action.nargs == "?":
            entry["const"] = _plain(action.const)
        if action.choices is not None and all(_plain(choice) is choice for choice in action.choices):
            entry["choices"] = list(action.choices)
        default = action.default
        if _plain(default) is default or isinstance(default, list) and all(_plain(item) is item for item in default):
            entry["default"] = default
        recorded.append(entry)
    return recorded


def _plain(value: Any) -> Any:
    """``value`` when JSON writes and reads it back as the same value (a string, number, bool or None), else None."""
    return value if value is None or type(value) in (str, int, float, bool) else None


def main(argv: list[str] | None = None) -> int:
    """``docs/cli.md`` on stdout, or with ``--flag-index`` the flag index written to ``vlfit/flag_index.json``."""
    if (sys.argv[1:] if argv is None else argv) == ["--flag-index"]:
        from vlfit.flag_index import INDEX_FILE, source_fingerprint

        recorded = {"fingerprint": source_fingerprint(), "commands": flag_index()}
        with open(INDEX_FILE, "w", encoding="utf-8") as f:
            f.write(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        print(f"wrote {INDEX_FILE}")
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
