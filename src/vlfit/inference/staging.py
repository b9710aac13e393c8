"""An export's folder is replaced whole or not at all (``vlfit export``, every ``--format``).

The export is written into a staging folder inside its output folder and its files are moved into place only when
everything there is written and checked, the record that describes them last (``vlfit.atomic_files.staged_folder``):
until then the output folder is as it was, a write that fails for want of space says so in one line, and a folder
holding anything but an earlier export is refused before any work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from vlfit.atomic_files import staged_folder
from vlfit.output_folders import EXPORT


def fp32_bytes(model: nn.Module) -> int:
    """What a graph of ``model``'s weights takes in fp32: about what an export of it writes."""
    return sum(parameter.numel() for parameter in model.parameters()) * 4


@contextlib.contextmanager
def staged_export(output_dir: str, record_name: str, *, expected_bytes: int) -> Iterator[str]:
    """Yield an empty staging folder inside ``output_dir`` to write an export into (``staged_folder``).

    Args:
        output_dir: The export's folder.
        record_name: The file that describes the others (a manifest), moved in last.
        expected_bytes: About what the export writes, for a full disk's message.
    """
    with staged_folder(
        output_dir,
        EXPORT.command,
        what="the export",
        record_name=record_name,
        expected_bytes=expected_bytes,
        remedy="free space there or export elsewhere (--output_dir)",
    ) as staging:
        yield staging
