"""The command-line reference, ``docs/cli.md``: every command's ``--help``, as ``vlfit <command> --help`` prints it;
and the flag index (``vlfit/flag_index.json``: each command's help and option strings, what ``vlfit`` answers
``--help`` and typos from before its heavy imports).

Regenerate both after changing a flag (``make docs``; a test fails while either is stale)::

    python -m vlfit.commands.cli_reference > docs/cli.md
    python -m vlfit.commands.cli_reference --flag-index
"""

from __future__ import annotations

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
    """Each command line's help (as ``docs/cli.md`` holds it) and the option strings its parser takes (recorded by
    ``CommandParser.print_help``)."""
    from vlfit.commands import parsing

    index: dict[str, Any] = {}
    for words in command_lines():
        prog = "vlfit " + " ".join(words)
        parsing.HELP_FLAG_RECORD.clear()
        text = help_text(words)
        index[prog] = {"help": text, "flags": sorted(parsing.HELP_FLAG_RECORD.get(prog, ()))}
    return index


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
