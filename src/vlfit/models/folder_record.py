"""A versioned JSON record saved beside a model's weights (``input_spec.json``, ``rerank.json``): written whole, and
read back only when it is JSON of a format this vlfit knows; what each record holds is checked by its own module."""

from __future__ import annotations

import json
import os
from typing import Any

from vlfit.atomic_files import write_file_atomically
from vlfit.errors import ModelLoadError


def save_folder_record(folder: str, file_name: str, record: dict[str, Any]) -> str:
    """Write ``record`` (with its ``format_version``) into ``folder`` as ``file_name``, atomically; its path."""
    path = os.path.join(folder, file_name)
    text = json.dumps(record, indent=2) + "\n"
    write_file_atomically(path, lambda f: f.write(text.encode()))
    return path


def read_folder_record(
    folder: str | None, file_name: str, *, format_version: int, what: str, remedy: str, newer: str
) -> tuple[str, dict[str, Any]] | None:
    """The record ``file_name`` in a model folder, with its path; None for no folder or a folder without one.

    Args:
        folder: The model folder.
        file_name: The record's file name.
        format_version: The newest format this vlfit reads.
        what: What the record holds, for the message of one that cannot be read ("the run's input settings").
        remedy: What to do about one that cannot be read.
        newer: The message for a record that is not a JSON object or is of a newer format (after the path).

    Raises:
        ModelLoadError: naming the file, for a record that is not JSON or of a newer format.
    """
    if folder is None or not os.path.isfile(path := os.path.join(folder, file_name)):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: cannot read {what} ({error}); {remedy}") from error
    if not isinstance(record, dict) or record.get("format_version", 0) > format_version:
        raise ModelLoadError(f"{path}: {newer}")
    return path, record
