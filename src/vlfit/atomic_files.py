"""Write a file so that a reader (or a resumed run) sees either the old file, the complete new one, or none.

The data goes to a hidden temporary file beside the target (``.{name}.{pid}.tmp``, same folder so the rename
stays on one filesystem), which is renamed over the target once the writer is done; a failure removes it. A disk
that fills meanwhile raises the ``OSError`` (ENOSPC) with the target as its ``filename``, so the message names it.

A durable write (``durable=True``: index files and their manifests, as checkpoints are written) also flushes the
temporary file to disk before the rename and the folder after it, so a power loss never leaves a name pointing at
data still in the page cache. ``write_file_atomically`` also counts and hashes the bytes as they are written: the
size and SHA-256 a manifest records for the file, to check it by later (``vlfit.index.integrity``).

A folder a command writes whole (``vlfit make-data``, ``merge``, ``export``, the demo's data: ``staged_folder``) is
written into a staging folder inside it (``STAGING_NAME``, same filesystem, so each move is a rename) and moved into
place once complete, the file that describes the others last; what an earlier write of the same command left there
is replaced, and a non-empty folder the command did not write is refused before any work (``claim_folder``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from vlfit.errors import NO_SPACE_ERRNOS, ConfigError, failed_write_error

# What ``temporary_path`` names its files: ``.{final name}.{pid}.tmp``.
TEMP_FILE_PATTERN = re.compile(r"^\.(?P<name>.+)\.\d+\.tmp$")
READ_BLOCK = 1 << 20  # bytes hashed at a time when a file is read back
STAGING_NAME = ".vlfit-staging"  # inside a staged folder: the write in progress
# In a staged folder: which command wrote it and the entries it wrote ({"written_by": ..., "entries": [...]}).
FOLDER_RECORD = ".vlfit-folder.json"


def temporary_path(path: str) -> str:
    """The hidden temporary file ``replace_on_success`` writes for ``path`` in this process."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp")


def fsync_file(path: str) -> None:
    """Flush ``path``'s data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: str) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk."""
    fsync_file(folder or ".")


@contextlib.contextmanager
def replace_on_success(path: str, *, durable: bool = False) -> Iterator[str]:
    """Yield a temporary path to write; rename it to ``path`` when the block succeeds, remove it when it raises.
    ``durable``: flush the file before the rename and its folder after it.

    Example::

        with replace_on_success("out/bench.json") as temp, open(temp, "w") as f:
            json.dump(results, f)
    """
    temp = temporary_path(path)
    try:
        yield temp
        if durable:
            fsync_file(temp)
        os.replace(temp, path)
        if durable:
            fsync_folder(os.path.dirname(path))
    except OSError as error:
        if error.errno in NO_SPACE_ERRNOS and not error.filename:
            error.filename = path  # a file's write() names no file: the full disk's message names this one
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)


def write_text_atomically(path: str, text: str, *, durable: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` through ``replace_on_success``."""
    with replace_on_success(path, durable=durable) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write(text)


@dataclass(frozen=True)
class WrittenFile:
    """What was written to a file: its size in bytes and the SHA-256 of its content (hex)."""

    size: int
    sha256: str

    def to_dict(self) -> dict[str, int | str]:
        return {"bytes": self.size, "sha256": self.sha256}


class _DigestingWriter:
    """A binary file that counts and hashes what is written through it."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._file.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def written(self) -> WrittenFile:
        return WrittenFile(self.size, self._hash.hexdigest())


def write_file_atomically(path: str, write: Callable[[BinaryIO], object], *, durable: bool = True) -> WrittenFile:
    """Write ``path`` through ``replace_on_success`` (durably by default): ``write(f)`` writes the content to ``f``,
    a binary file that counts and hashes the bytes as they pass. Returns their size and SHA-256."""
    with replace_on_success(path, durable=durable) as temp, open(temp, "wb") as f:
        writer = _DigestingWriter(f)
        write(writer)  # type: ignore[arg-type]
        writer.flush()
    return writer.written()


def digest_file(path: str) -> WrittenFile:
    """The size and SHA-256 of ``path`` as it is on disk (read a block at a time)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            digest.update(block)
            size += len(block)
    return WrittenFile(size, digest.hexdigest())


def refuse_file_as_folder(path: str, flag: str = "--output_dir") -> None:
    """Refuse, in one line naming ``flag``, a folder to write into that is a file or lies under one.

    Raises:
        ConfigError: ``path`` (or the first part of it that exists) is not a folder.
    """
    here = os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if os.path.isdir(here) or not os.path.lexists(here):
        return
    where = "is a file" if here == os.path.abspath(path) else f"lies under the file {here}"
    raise ConfigError(f"{flag} {path} {where}, not a folder: name a folder to write into (a new or empty one)")


def _written_by(folder: str) -> dict[str, object] | None:
    """``folder``'s ``FOLDER_RECORD``, or None without a readable one."""
    try:
        with open(os.path.join(folder, FOLDER_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def claim_folder(
    folder: str,
    command: str,
    *,
    flag: str = "--output_dir",
    records: tuple[str, ...] = (),
    names: frozenset[str] = frozenset(),
) -> set[str]:
    """The entries an earlier write of ``command`` left in ``folder`` (for the new write to replace), or refuse a
    folder that holds anything ``command`` did not write.

    A folder is ``command``'s when it is new or empty, when its ``FOLDER_RECORD`` names ``command``, when it holds
    one of ``records`` (the files a write of ``command`` ends with, for folders written before they were recorded), or
    when every entry in it is one of ``names`` (what ``command`` writes there). A write in progress that was killed
    (``STAGING_NAME``) is nobody's and is replaced.

    Raises:
        ConfigError: ``folder`` is a file, holds what another command wrote, or holds files of its own.
    """
    refuse_file_as_folder(folder, flag)
    entries = set(os.listdir(folder)) - {STAGING_NAME} if os.path.isdir(folder) else set()
    if not entries:
        return set()
    record = _written_by(folder)
    again = f"name a new or empty folder ({flag})"
    if record is not None:
        if record.get("written_by") != command:
            raise ConfigError(f"{flag} {folder} holds what {record.get('written_by')} wrote, not {command}: {again}")
        listed = record.get("entries")
        return entries & {*(listed if isinstance(listed, list) else []), FOLDER_RECORD}
    if entries & set(records):
        return entries & set(records)
    if entries <= names:
        return entries
    shown = ", ".join(sorted(entries)[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise ConfigError(f"{flag} {folder} is not empty ({shown}) and {command} did not write it: {again}")


@contextlib.contextmanager
def staged_folder(
    folder: str,
    command: str,
    *,
    what: str,
    flag: str = "--output_dir",
    record_name: str | None = None,
    names: frozenset[str] = frozenset(),
    expected_bytes: int | None = None,
    remedy: str | None = None,
) -> Iterator[str]:
    """Yield an empty staging folder inside ``folder`` (``claim_folder``'s: refused before any work when it is not
    ``command``'s) to write ``folder``'s content into.

    When the block completes, the staged entries replace what an earlier write of ``command`` left (``record_name``
    out first and in last: a reader that finds it finds the files it describes), and ``FOLDER_RECORD`` lists them.
    When it raises, nothing in ``folder`` is replaced, and a write that failed for
    want of space is raised as one line (``vlfit.errors.failed_write_error``). The staging folder is removed either
    way.

    Args:
        folder: The folder to write.
        command: What writes it (``vlfit make-data``), recorded and named in refusals.
        what: What is written (``the export``), for a full disk's message.
        flag: The flag that named ``folder``, for messages.
        record_name: The file that describes the others (a manifest), moved in last.
        names: What ``command`` writes in ``folder`` (see ``claim_folder``).
        expected_bytes: About what the write takes, for a full disk's message.
        remedy: What to do on a full disk (default: free space or write elsewhere, ``flag``).
    """
    previous = claim_folder(folder, command, flag=flag, records=(record_name,) if record_name else (), names=names)
    os.makedirs(folder, exist_ok=True)
    staging = os.path.join(folder, STAGING_NAME)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        try:
            yield staging
        except Exception as error:  # while staging: the folder is as it was
            staged = sum(os.path.getsize(os.path.join(r, n)) for r, _, files in os.walk(staging) for n in files)
            note = f"nothing in {folder} was replaced ({what} is staged in {STAGING_NAME} and moved in once complete)"
            failure = failed_write_error(
                error,
                folder,
                needed=max(expected_bytes or 0, staged) or None,
                note=note,
                remedy=remedy or f"free space there or write elsewhere ({flag})",
            )
            if failure is None:
                raise
            raise failure from error
        _move_into(staging, folder, command, record_name, previous)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_into(staging: str, folder: str, command: str, record_name: str | None, previous: set[str]) -> None:
    """Move the staged entries into ``folder`` in place of ``previous`` (and of those of the same names),
    ``record_name`` last."""
    staged = sorted(os.listdir(staging))
    last = [record_name] if record_name in staged else []
    first = [name for name in (record_name, FOLDER_RECORD) if name]
    for name in [*first, *sorted((previous | set(staged)) - set(first))]:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    for name in staged:
        if name not in last:
            os.replace(os.path.join(staging, name), os.path.join(folder, name))
    record = {"written_by": command, "entries": staged}
    write_text_atomically(os.path.join(folder, FOLDER_RECORD), json.dumps(record, indent=1) + "\n")
    for name in last:
        os.replace(os.path.join(staging, name), os.path.join(folder, name))
