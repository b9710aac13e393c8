"""File specs on the command line: paths, globs, ``{a..b}``/``{x,y}`` braces and comma-separated lists."""

from __future__ import annotations

import glob
import os

from braceexpand import UnbalancedBracesError, braceexpand

from vlfit.errors import MissingFileError


def expand_braces(pattern: str) -> list[str]:
    """Expand bash-style braces: ``a-{000..002}.tar`` and ``{train,extra}.tar`` (zero padding is kept).

    Args:
        pattern: A path pattern. Text without braces, a brace with neither a comma nor a range (``{x}``) and braces
            that do not pair up are left as they are.

    Returns:
        The expanded patterns, in order.
    """
    try:
        # escape=False: a backslash belongs to the path; it does not escape a brace.
        return list(braceexpand(pattern, escape=False))
    except UnbalancedBracesError:
        return [pattern]


def _expand_spec(spec: str) -> list[str]:
    """The patterns of a comma-separated spec, each with its braces expanded, blank parts left out.

    Raises:
        UnbalancedBracesError: when the spec's braces do not pair up.
    """
    # A comma-separated list is a brace sequence without its braces, so braceexpand splits it when given them: commas
    # inside braces stay alternatives of their own brace. The empty last alternative makes a spec without a comma a
    # sequence too (braces around a single item are kept literally) and is dropped with the other blank parts.
    parts = braceexpand("{" + spec + ",}", escape=False)
    return [part.strip() for part in parts if part.strip()]


def resolve_files(spec: str) -> list[str]:
    """Turn a file spec (path, glob, ``{a..b}`` braces, or a comma-separated list of these) into file paths.

    Args:
        spec: The spec as given on the command line.

    Returns:
        Existing file paths; glob matches are sorted, duplicates removed, order otherwise kept.

    Raises:
        FileNotFoundError: naming the pattern that matched nothing or the file that does not exist.
    """
    try:
        parts = _expand_spec(spec)
    except UnbalancedBracesError:
        path = os.path.expanduser(spec.strip())
        if os.path.isfile(path):  # a file whose name has a brace in it
            return [path]
        raise MissingFileError(f"file not found: {spec!r} (its braces do not pair up, so none was expanded)") from None
    files: dict[str, None] = {}
    for part in parts:
        pattern = os.path.expanduser(part)
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise MissingFileError(f"no files match the pattern {pattern!r} (from {spec!r})")
            files.update(dict.fromkeys(matches))
        elif os.path.isfile(pattern):
            files[pattern] = None
        else:
            raise MissingFileError(f"file not found: {pattern!r} (from {spec!r})")
    if not files:
        raise MissingFileError(f"no files given in {spec!r}")
    return list(files)


def is_stream_spec(spec: str | None) -> bool:
    """Whether a file spec (``--train_file``, ``--validation_file``, a ``--dataset_name`` of shards) can only be
    streamed: several ``::`` sources, or a URL (``https://``, ``s3://``...) rather than a local path."""
    if not spec:
        return False
    return "::" in spec or any("://" in part and not part.startswith("file://") for part in spec.split("::"))
