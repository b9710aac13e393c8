"""The WebDataset naming rules both tar readers share: the map-style ``TarSource`` (``vlfit.data.sources.tar``) and
the streamed shard reader (``vlfit.data.stream.shards``), so a shard reads the same either way.

Members group into samples by key (``split_member_name``); ``WebDatasetLayout`` says which member of a sample is
its image, its caption, each extra column and its image id (``SampleMembers``), and turns the members' bytes into a
``Record``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlfit.data.columns import DEFAULT_COLUMNS, as_caption, is_default_column
from vlfit.data.records import BadRecordError, Record
from vlfit.errors import DataError

WEBDATASET_IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")


def split_member_name(name: str) -> tuple[str, str] | None:
    """WebDataset grouping: ``(key, extension)`` of a member, the key being the path up to the first dot of the
    basename and the extension the rest (lower-cased); ``None`` for a name without an extension or a hidden file."""
    folder, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


@dataclass(frozen=True)
class SampleMembers:
    """Which member extension of one sample plays which part (``None``: the sample has no such member); the
    ``.json`` member, when there is one, is always ``json``.

    Attributes:
        image: The image member.
        text: The caption member (see ``WebDatasetLayout``).
        extras: Per column of ``WebDatasetLayout.read_columns``, the member holding it.
    """

    image: str | None
    text: str | None
    extras: tuple[str | None, ...]


@dataclass(frozen=True)
class WebDatasetLayout:
    """Where a WebDataset sample keeps its image, caption, extra columns and image id, and how they make a ``Record``.

    For tar shards a column is a member extension (or, for the caption, a key of the ``.json`` member). A column
    flag left at its default (``vlfit.data.columns.is_default_column``) finds the common members: the image is
    the ``.image`` member or else the first of ``jpg``/``jpeg``/``png``/``webp``; the caption is the member of that
    name, else ``.txt``, else a member or ``.json`` key with one of the common caption names
    (``DEFAULT_COLUMNS["caption"]``). A column named on purpose is that member (the caption: that member, else that
    ``.json`` key), with no fallback: a shard whose first sample has no such thing is a ``DataError`` naming the
    flag, the shard and what the sample has (``check_columns``; a later sample without it has no image or no
    caption, a bad sample). Extra columns come from a member with that extension (parsed as JSON when possible) or
    from the ``.json`` member. The id is the key.

    Args:
        image_column: The image member extension (``--image_column``).
        caption_column: The caption member extension, or the key in the ``.json`` member (``--caption_column``).
        extra_columns: Values copied into ``Record.extra`` when present.
        image_id_column: A member extension or ``.json`` key naming the image a sample shows
            (``Record.image_id``), read like an extra column; ``None``: samples are grouped by their image bytes.
    """

    image_column: str = "image"
    caption_column: str = "txt"
    extra_columns: tuple[str, ...] = ()
    image_id_column: str | None = None

    @property
    def read_columns(self) -> tuple[str, ...]:
        """The extra columns and the image id column, each once: what ``SampleMembers.extras`` lists."""
        ids = [self.image_id_column] if self.image_id_column else []
        return tuple(dict.fromkeys([*self.extra_columns, *ids]))

    @property
    def _image_members(self) -> tuple[str, ...]:
        """The member extensions that may hold the image, in order of preference."""
        if is_default_column("image", self.image_column):
            return (self.image_column, *WEBDATASET_IMAGE_EXTENSIONS)
        return (self.image_column,)

    @property
    def _caption_members(self) -> tuple[str, ...]:
        """The member extensions that may hold the caption, in order of preference."""
        if is_default_column("caption", self.caption_column):
            return tuple(dict.fromkeys((self.caption_column, "txt", *DEFAULT_COLUMNS["caption"])))
        return (self.caption_column,)

    def caption_key(self, meta: Mapping[str, Any]) -> str:
        """The ``.json`` key that holds the caption."""
        if is_default_column("caption", self.caption_column):
            return next((c for c in DEFAULT_COLUMNS["caption"] if c in meta), self.caption_column)
        return self.caption_column

    def members(self, extensions: Collection[str]) -> SampleMembers:
        """The part each of a sample's member extensions plays."""
        image = next((e for e in self._image_members if e in extensions), None)
        text = next((e for e in self._caption_members if e in extensions), None)
        extras = tuple(c if c in extensions else None for c in self.read_columns)
        return SampleMembers(image, text, extras)

    def check_columns(self, shard: str, key: str, extensions: Collection[str], meta: Mapping[str, Any]) -> None:
        """Check a shard's first sample for the columns named on purpose (the defaults find what there is).

        Args:
            shard: The shard, for the message.
            key: The sample's key.
            extensions: Its member extensions.
            meta: Its parsed ``.json`` member (``{}`` without one).

        Raises:
            DataError: naming the flag, the shard and the sample's members and ``.json`` keys, when an explicit
                ``--image_column`` is not one of its members or an explicit ``--caption_column`` neither a member
                nor a ``.json`` key.
        """
        has = f"its first sample {key!r} has members {sorted(extensions)}"
        if not is_default_column("image", self.image_column) and self.image_column not in extensions:
            raise DataError(
                f"--image_column {self.image_column!r}: shard {shard} has no '.{self.image_column}' member ({has}); "
                f"name the image member's extension with --image_column, or leave it out for the first of "
                f"{list(WEBDATASET_IMAGE_EXTENSIONS)}"
            )
        caption = self.caption_column
        if not is_default_column("caption", caption) and caption not in extensions and caption not in meta:
            raise DataError(
                f"--caption_column {caption!r}: shard {shard} has no '.{caption}' member and no .json key {caption!r} "
                f"({has} and .json keys {sorted(meta)}); name the caption's member extension or .json key with "
                "--caption_column, or leave it out for the '.txt' member"
            )

    @staticmethod
    def missing_image(key: str, shard: str, extensions: Collection[str]) -> str:
        """The reason a sample without an image member is refused."""
        return (
            f"sample {key!r} in shard {shard} has no image member (found extensions {sorted(extensions)}; "
            f"expected one of {list(WEBDATASET_IMAGE_EXTENSIONS)})"
        )

    @staticmethod
    def parse_json(key: str, raw: bytes | None) -> dict[str, Any]:
        """The ``.json`` member as a dict (``{}`` without one, or when it holds another JSON value).

        Raises:
            BadRecordError: naming the sample when the member is not valid JSON.
        """
        if raw is None:
            return {}
        try:
            meta = json.loads(raw)
        except ValueError as err:
            raise BadRecordError(f"sample {key}: invalid json member: {err}") from err
        return meta if isinstance(meta, dict) else {}

    def caption(self, text: bytes | None, meta: dict[str, Any]) -> str | None:
        """The caption: the caption member's text when there is one, else the caption's ``.json`` key."""
        return _text(text) if text is not None else as_caption(meta.get(self.caption_key(meta)))

    def record(
        self, key: str, image: bytes, text: bytes | None, meta: dict[str, Any], extras: Sequence[bytes | None]
    ) -> Record:
        """Assemble a sample's record from its members' bytes.

        Args:
            key: The sample's key (its id).
            image: The image member.
            text: The caption member, if any.
            meta: The parsed ``.json`` member (``parse_json``).
            extras: Per column of ``read_columns``, its member's bytes or ``None``.
        """
        extra: dict[str, Any] = {}
        for column, raw in zip(self.read_columns, extras, strict=True):
            if raw is not None:
                value = _text(raw)
                try:
                    extra[column] = json.loads(value)
                except ValueError:
                    extra[column] = value
            elif column in meta:
                extra[column] = meta[column]
        image_id = extra.get(self.image_id_column) if self.image_id_column else None
        extra = {column: extra[column] for column in self.extra_columns if column in extra}
        return Record(key, image, self.caption(text, meta), extra, image_id=None if image_id is None else str(image_id))


def _text(raw: bytes) -> str:
    # Invalid UTF-8 becomes U+FFFD rather than a bad sample: web captions often carry a few mis-encoded
    # bytes in otherwise good text (see vlfit.data.bad_samples).
    return raw.decode("utf-8", errors="replace").strip()
