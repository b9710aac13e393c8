"""Write a file so that a reader (or a resumed run) sees either the old file, the complete new one, or none.

The data goes to a hidden temporary file beside the target (``.{name}.{pid}.tmp``, same folder so the rename
stays on one filesystem), which is renamed over the target once the writer is done; a failure removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

# What ``temporary_path`` names its files: ``.{final name}.{pid}.tmp``.
TEMP_FILE_PATTERN = re.compile(r"^\.(?P<name>.+)\.\d+\.tmp$")


def temporary_path(path: str) -> str:
    """The hidden temporary file ``replace_on_success`` writes for ``path`` in this process."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def replace_on_success(path: str) -> Iterator[str]:
    """Yield a temporary path to write; rename it to ``path`` when the block succeeds, remove it when it raises.

    Example::

        with replace_on_success("out/bench.json") as temp, open(temp, "w") as f:
            json.dump(results, f)
    """
    temp = temporary_path(path)
    try:
        yield temp
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through ``replace_on_success``."""
    with replace_on_success(path) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write(text)
