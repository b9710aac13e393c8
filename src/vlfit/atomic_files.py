"""Write a file so that a reader (or a resumed run) sees either the old file, the complete new one, or none.

The data goes to a hidden temporary file beside the target (``.{name}.{pid}.tmp``, same folder so the rename
stays on one filesystem), which is renamed over the target once the writer is done; a failure removes it. A disk
that fills meanwhile raises the ``OSError`` (ENOSPC) with the target as its ``filename``, so the message names it.

A durable write (``durable=True``: index files and their manifests, as checkpoints are written) also flushes the
temporary file to disk before the rename and the folder after it, so a power loss never leaves a name pointing at
data still in the page cache. ``write_file_atomically`` also counts and hashes the bytes as they are written: the
size and SHA-256 a manifest records for the file, to check it by later (``vlfit.index.integrity``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from vlfit.errors import NO_SPACE_ERRNOS

# What ``temporary_path`` names its files: ``.{final name}.{pid}.tmp``.
TEMP_FILE_PATTERN = re.compile(r"^\.(?P<name>.+)\.\d+\.tmp$")
READ_BLOCK = 1 << 20  # bytes hashed at a time when a file is read back


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
