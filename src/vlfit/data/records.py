"""The unit every source yields: encoded image bytes, a caption and an id. Nothing here decodes pixels."""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field
from typing import Any

from vlfit.errors import DataError

# Columns evaluation reads besides image and caption (New Yorker ``matching``): carried through as ``extra``.
EVAL_COLUMNS: tuple[str, ...] = ("caption_choices", "label")
# The per-row column a batch derives from them: the index of the one choice equal to the row's caption, or None
# (vlfit.data.hard_negatives.caption_choice; evaluation takes it as the right choice where there is no label).
CAPTION_CHOICE = "caption_choice"


@dataclass(frozen=True)
class Record:
    """One image-text sample as it is stored.

    Args:
        id: A stable identifier (used in error messages, skip counts and evaluation).
        image: The encoded image file (JPEG, PNG, ...), exactly as stored.
        caption: The caption text (may be empty or ``None`` when the data is dirty; later stages decide).
        extra: Other columns the caller asked for (for example ``caption_choices`` and ``label``).
        image_id: Which image this is, from ``--image_id_column``; ``None``: the image is known by its bytes.
    """

    id: str
    image: bytes
    caption: str | None
    extra: dict[str, Any] = field(default_factory=dict)
    image_id: str | None = None

    @property
    def image_key(self) -> int:
        """``image_key(self.image, self.image_id)``: rows with equal keys show the same image."""
        return image_key(self.image, self.image_id)


def image_key(image: bytes, image_id: str | None = None) -> int:
    """A signed 64-bit key of an image: several captions of one image, or rows repeating its bytes, share it.

    From ``image_id`` (``--image_id_column``) when there is one, else from the encoded bytes (SHA-1, about 0.1 ms
    for a 150 KB JPEG: noise beside its decode).
    """
    data = b"id:" + image_id.encode("utf-8") if image_id is not None else image
    digest = hashlib.sha1(data, usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


class BadRecordError(DataError):
    """A stored sample cannot be turned into a record (missing file, unsupported image value...)."""


def image_value_to_bytes(value: Any, *, base_dir: str | None = None, sample_id: str = "?") -> bytes:
    """Return the encoded bytes behind any image value a dataset column may hold, without decoding pixels.

    Accepted values: ``{"bytes": ..., "path": ...}`` (the datasets ``Image(decode=False)`` form), raw ``bytes``,
    a path string (relative paths resolve against ``base_dir``), or a ``PIL.Image.Image``. A PIL image has no
    encoded form left, so it is re-encoded losslessly as PNG (prefer ``Image(decode=False)`` columns).

    Raises:
        BadRecordError: naming the sample when the value is none of these or its file cannot be read.
    """
    if isinstance(value, dict):
        data = value.get("bytes")
        if data:
            return bytes(data)
        path = value.get("path")
        if path:
            return _read_file(path, base_dir, sample_id)
        raise BadRecordError(f"sample {sample_id}: image value has neither bytes nor path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return _read_file(value, base_dir, sample_id)
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None  # type: ignore[assignment]
    if Image is not None and isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    if value is None:
        raise BadRecordError(f"sample {sample_id}: image is missing (None)")
    raise BadRecordError(
        f"sample {sample_id}: unsupported image value of type {type(value).__name__}; "
        "expected {bytes, path} dict, bytes, a path string or a PIL image (is --image_column the image column?)"
    )


def _read_file(path: str, base_dir: str | None, sample_id: str) -> bytes:
    full = path if os.path.isabs(path) or base_dir is None else os.path.join(base_dir, path)
    try:
        with open(full, "rb") as f:
            return f.read()
    except OSError as err:
        raise BadRecordError(f"sample {sample_id}: cannot read image file {full!r}: {err.strerror}") from err
