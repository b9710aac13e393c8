"""Reading an ANN structure's file (``ann.faiss``) as its SHA-256 is computed: ``read_hashed``, for
``vlfit.index.ann.AnnIndex.load``."""

from __future__ import annotations

import hashlib
from typing import Any

from vlfit.atomic_files import WrittenFile
from vlfit.index.integrity import DamagedIndexError


def read_hashed(faiss: Any, path: str, repair: str, binary: bool = False) -> tuple[Any, WrittenFile]:
    """The faiss index in ``path`` (``binary``: a binary index), read into memory, and the size and SHA-256 of the
    bytes it was read from.

    Raises:
        DamagedIndexError: when faiss cannot parse the file (cut short, or not an index).
    """
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:

        def read(count: int) -> bytes:
            nonlocal size
            block = f.read(count)
            digest.update(block)
            size += len(block)
            return block

        try:
            index = (faiss.read_index_binary if binary else faiss.read_index)(faiss.PyCallbackIOReader(read))
        except RuntimeError as err:
            problem = f"does not parse as a faiss index ({first_error_line(err)})"
            raise DamagedIndexError(path, problem, repair) from None
        while read(1 << 20):  # what faiss left unread is part of the file too
            pass
    return index, WrittenFile(size, digest.hexdigest())


def first_error_line(error: BaseException) -> str:
    """faiss's message without the C++ function, file and line it names (``Error in ... at file:line: Error: ...``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0].rsplit("Error: ", 1)[-1] if lines else type(error).__name__


__all__ = ["first_error_line", "read_hashed"]
