"""File specs on the command line: paths, globs, ``{a..b}``/``{x,y}`` braces and comma-separated lists."""

from __future__ import annotations

import glob
import os
import re


def _split_top_level(spec: str) -> list[str]:
    """Split a comma-separated list, leaving commas inside ``{a,b}`` braces alone."""
    parts, depth, current = [], 0, []
    for char in spec:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += char == "{"
        depth -= char == "}" and depth > 0
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def expand_braces(pattern: str) -> list[str]:
    """Expand shell-style braces: ``a-{000..002}.tar`` and ``{train,extra}.tar`` (zero padding is kept).

    Args:
        pattern: A path pattern; text without braces is returned unchanged.

    Returns:
        The expanded patterns, in order.
    """
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end() :], match.group(1)
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        first, last = numeric.groups()
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        step = 1 if int(last) >= int(first) else -1
        options = [str(i).zfill(width) for i in range(int(first), int(last) + step, step)]
    elif "," in body:
        options = body.split(",")
    else:
        return [head + "{" + body + "}" + t for t in expand_braces(tail)]
    return [expanded for option in options for expanded in expand_braces(head + option + tail)]


def resolve_files(spec: str) -> list[str]:
    """Turn a file spec (path, glob, ``{a..b}`` braces, or a comma-separated list of these) into file paths.

    Args:
        spec: The spec as given on the command line.

    Returns:
        Existing file paths; glob matches are sorted, duplicates removed, order otherwise kept.

    Raises:
        FileNotFoundError: naming the pattern that matched nothing or the file that does not exist.
    """
    files: dict[str, None] = {}
    for part in _split_top_level(spec):
        for pattern in expand_braces(os.path.expanduser(part)):
            if glob.has_magic(pattern):
                matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
                if not matches:
                    raise FileNotFoundError(f"no files match the pattern {pattern!r} (from {spec!r})")
                files.update(dict.fromkeys(matches))
            elif os.path.isfile(pattern):
                files[pattern] = None
            else:
                raise FileNotFoundError(f"file not found: {pattern!r} (from {spec!r})")
    if not files:
        raise FileNotFoundError(f"no files given in {spec!r}")
    return list(files)
