"""The column rules every reader of stored rows shares (map-style sources, tar members, streamed parquet rows):
which column holds the image, the caption and the id when a flag is left at its default, how a stored caption
value becomes text, and which columns an opener asks a source for (``Columns``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlfit.errors import DataError

logger = logging.getLogger(__name__)


# The columns a source looks for when a column flag is left at its default (the first name), in order: the names
# common data uses (HF imagefolder's metadata file_name/text, COCO-style image/caption, open_clip's CSV
# filepath/title). An explicit flag naming another column always wins, and names a column that must exist.
DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {
    "image": ("image", "file_name", "image_path", "filepath"),
    "caption": ("image_description", "caption", "text", "captions", "title"),
}


def is_default_column(role: str, column: str | None) -> bool:
    """Whether ``column`` is what the ``role`` flag holds when not given (``DEFAULT_COLUMNS[role][0]``): the source
    then looks for the common names, where a column named on purpose must exist."""
    candidates = DEFAULT_COLUMNS.get(role, ())
    return bool(candidates) and column == candidates[0]


def resolve_column(role: str, column: str, available: Sequence[str], *, name: str, flag: str) -> str:
    """The column that holds ``role`` (``image``, ``caption``) in a source with columns ``available``.

    ``column`` is used when present. When it is the role's default (``DEFAULT_COLUMNS[role][0]``, what the flag
    holds when not given) and absent, the first of the role's other common names present is used instead.

    Args:
        role: What the column holds, as error messages call it.
        column: The flag's value.
        available: The source's columns.
        name: The source, for error messages.
        flag: The flag that names the column (``--image_column``).

    Raises:
        DataError: naming the source, the flag and the available columns, when no such column is there.
    """
    if column in available:
        return column
    candidates = DEFAULT_COLUMNS.get(role, ())
    tried = ""
    if is_default_column(role, column):
        found = next((c for c in candidates[1:] if c in available), None)
        if found is not None:
            logger.info("%s: the %s column is %r (%s not given, and no %r column)", name, role, found, flag, column)
            return found
        tried = f" (nor {', '.join(map(repr, candidates[1:]))})"
    raise DataError(
        f"{name}: {role} column {column!r} not found{tried}; available columns: {list(available)}. "
        f"Name the {role} column with {flag}."
    )


def default_id_column(columns: Sequence[str]) -> str | None:
    """The id column a source uses when ``--id_column`` is not given: ``instance_id`` or ``id`` when present."""
    return next((c for c in ("instance_id", "id") if c in columns), None)


def as_caption(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):  # CSV readers turn empty cells into NaN
        return None
    if isinstance(value, bytes):  # a binary column: decode it (str() would give "b'...'"), as tar captions are
        return value.decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Columns:
    """Which columns an opener reads, and what its messages call the caption column and its flag."""

    image: str
    caption: str | None
    id: str | None
    extras: tuple[str, ...]
    caption_role: str = "caption"
    image_id: str | None = None
    caption_flag: str | None = None
