"""How an index's files are checked against what its manifest records, and the one error a damaged index raises.

Each file an index writes (a shard's embeddings, ids and captions, ``ann.faiss``) is counted and hashed as it is
written (``vlfit.atomic_files.write_file_atomically``), and the manifest records ``{"bytes", "sha256"}`` of it.
Two levels of checking (``--verify``):

- ``quick`` (the default where an index is opened): the manifest parses and every file it names exists with the
  size it records. A stat per file: an index of any size opens at once.
- ``full``: also the SHA-256 of every file, that each ids and captions file parses and holds its shard's rows, and
  that every embedding is finite (no NaN or infinity). Reads the whole index once.

An index written before sizes and checksums were recorded gets what can be checked without them: the files exist
(``quick``), and parse, hold their rows and finite embeddings (``full``); ``verify_index`` says so in its notes.

A problem is reported in one line naming the file, what is wrong with it and the command that rebuilds it
(``vlfit.index.store.rebuild_command``): ``vlfit retrieve index`` over the same folder re-embeds the items of a
damaged shard and rebuilds a damaged ANN structure.
"""

from __future__ import annotations

import os
from typing import Any

from vlfit.atomic_files import WrittenFile, digest_file
from vlfit.errors import ConfigError, DataError

VERIFY_LEVELS = ("quick", "full")


class DamagedIndexError(DataError):
    """An index file that is missing, of another size or checksum than its manifest records, or that does not
    parse: the message (one line) names the file, what is wrong with it and the command that rebuilds it.

    Args:
        file: The damaged file.
        problem: What is wrong with it.
        repair: The command that rebuilds it (``vlfit.index.store.rebuild_command``).
    """

    def __init__(self, file: str, problem: str, repair: str) -> None:
        super().__init__(f"{file}: {problem}; rebuild it: {repair}")
        self.file, self.problem, self.repair = file, problem, repair

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.file, self.problem, self.repair)


def check_verify_level(level: str) -> None:
    """Raises ``ConfigError`` unless ``level`` is ``quick`` or ``full``."""
    if level not in VERIFY_LEVELS:
        raise ConfigError(f"--verify must be one of {', '.join(VERIFY_LEVELS)}, got {level!r}")


def file_problem(path: str, recorded: dict[str, Any] | None, level: str) -> str | None:
    """What is wrong with ``path`` against ``recorded`` (``{"bytes", "sha256"}`` from the manifest, or None when it
    records nothing for the file), at ``level``; None when nothing is.

    ``quick``: it exists with the recorded size; ``full``: its SHA-256 too.
    """
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if recorded is None:
        return None
    expected = int(recorded.get("bytes", -1))
    if expected >= 0 and size != expected:
        shorter = " (truncated)" if size < expected else ""
        return f"{size} bytes, the manifest records {expected}{shorter}"
    if level == "full" and recorded.get("sha256"):
        try:
            found = digest_file(path)
        except OSError as err:
            return f"cannot be read ({err.strerror})"
        return sha256_problem(found, recorded)
    return None


def sha256_problem(found: WrittenFile, recorded: dict[str, Any] | None) -> str | None:
    """What differs between the bytes read (``found``) and what the manifest records; None when nothing does."""
    if not recorded:
        return None
    expected = int(recorded.get("bytes", -1))
    if expected >= 0 and found.size != expected:
        return f"{found.size} bytes, the manifest records {expected}"
    if recorded.get("sha256") and found.sha256 != recorded["sha256"]:
        return f"checksum {found.sha256[:12]}..., the manifest records {str(recorded['sha256'])[:12]}... (changed)"
    return None


__all__ = [
    "VERIFY_LEVELS",
    "DamagedIndexError",
    "check_verify_level",
    "file_problem",
    "sha256_problem",
]
