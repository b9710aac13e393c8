"""An export's folder is replaced whole or not at all (``vlfit export``, every ``--format``).

The export is written into a staging folder inside its output folder (``.export-staging``, same filesystem, so each
move is a rename). Only when everything there is written and checked are its files moved into place, the record that
describes them last: a reader that finds the record finds the files it names. Until then the output folder is as it
was, and a write that fails for want of space says so in one line (``vlfit.errors.failed_write_error``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

from torch import nn

from vlfit.errors import WriteFailedError, failed_write_error

STAGING_NAME = ".export-staging"


def fp32_bytes(model: nn.Module) -> int:
    """What a graph of ``model``'s weights takes in fp32: about what an export of it writes."""
    return sum(parameter.numel() for parameter in model.parameters()) * 4


@contextlib.contextmanager
def staged_export(output_dir: str, record_name: str, *, expected_bytes: int) -> Iterator[str]:
    """Yield an empty staging folder inside ``output_dir`` (created) to write an export into.

    When the block completes, its files replace those of the same names in ``output_dir``, ``record_name`` last (a
    stale record is removed first). When it raises, nothing in ``output_dir`` is replaced, and a write that failed
    is raised as one line (``failed_export_write``). The staging folder is removed either way.

    Args:
        output_dir: The export's folder.
        record_name: The file that describes the others (a manifest), moved in last.
        expected_bytes: About what the export writes, for a full disk's message.
    """
    os.makedirs(output_dir, exist_ok=True)
    staging = os.path.join(output_dir, STAGING_NAME)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
    except Exception as error:  # while staging: the output folder is as it was
        failure = failed_export_write(error, output_dir, staging, expected_bytes)
        if failure is None:
            raise
        raise failure from error
    else:
        _move_into(staging, output_dir, record_name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def failed_export_write(
    error: BaseException, output_dir: str, staging: str, expected_bytes: int
) -> WriteFailedError | None:
    """``error``, raised while the export was staged, as one line when it is a write that failed
    (``vlfit.errors.failed_write_error``: the disk full, or torch's writer failing without an errno); None for any
    other error. The line names the output folder, its free space, about what the export takes (``expected_bytes``,
    or what was staged before the write failed, when more) and that nothing in the folder was replaced."""
    staged = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(staging) for name in names)
    note = (
        f"nothing in {output_dir} was replaced (the export is staged in {os.path.basename(staging)} and moved in "
        "once complete)"
    )
    return failed_write_error(
        error,
        output_dir,
        needed=max(expected_bytes, staged),
        note=note,
        remedy="free space there or export elsewhere (--output_dir)",
    )


def _move_into(staging: str, output_dir: str, record_name: str) -> None:
    """Move the staged files into ``output_dir``, ``record_name`` last."""
    stale = os.path.join(output_dir, record_name)
    if os.path.exists(stale):
        os.remove(stale)
    for name in [*(name for name in os.listdir(staging) if name != record_name), record_name]:
        target = os.path.join(output_dir, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)
