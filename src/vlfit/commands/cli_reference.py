"""The command-line reference, ``docs/cli.md``: every command's ``--help``, as ``vlfit <command> --help`` prints it.

Regenerate it after changing a flag (a test fails while it is stale)::

    python -m vlfit.commands.cli_reference > docs/cli.md
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

REGENERATE = "python -m vlfit.commands.cli_reference > docs/cli.md"
# argparse wraps help to the terminal's width: fixed, so the page does not depend on who generated it.
HELP_COLUMNS = "120"
# Commands with subcommands, each with flags of its own.
SUBCOMMANDS = {"retrieve": ("index", "query", "verify")}


def command_lines() -> list[list[str]]:
    """The command lines documented: ``[command]`` or ``[command, subcommand]``, in ``vlfit --help``'s order."""
    from vlfit.cli import COMMANDS

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
            main([*words, "--help"])
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


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
