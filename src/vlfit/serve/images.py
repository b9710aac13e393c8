"""Images the server decodes, each bounded before it is decoded: query images (a pixel cap read from the header)
and thumbnails of indexed images (a DCT-scaled decode, an LRU cache of the small JPEGs they become).

A query image is checked from its header (microseconds, no pixel decoded) against ``--max_query_pixels``, far
below Pillow's 178.9-megapixel bomb limit that training data gets; the decode that follows is DCT-scaled for JPEG
(libjpeg-turbo decodes at 1/2, 1/4 or 1/8 of the size, never above what the model needs: a 40-megapixel JPEG is
decoded at about 0.6 megapixels). Formats without scaled decoding (PNG, WebP, ...) decode at full size, which the
pixel cap bounds. A thumbnail is decoded the same way (``draft`` before the EXIF rotation, so a 12000-pixel JPEG
becomes a 1500-pixel one while it is read). The threads that decode them run at a lower CPU priority than the text
queries' (``yield_to_text_queries``), so a slow decode takes the cores only when the text queries leave them.

An indexed file that cannot be shown (gone, a link out of the indexed root the index did not record, not an image)
is answered 404 or 422 by ``IndexedThumbnails``, naming the item by its number and at most its path relative to its
folder, never the file's bytes or size; the server's log says which file and why, once per item.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections import OrderedDict

from PIL import Image, UnidentifiedImageError

from vlfit.data.decode import check_image_header, decode_pil
from vlfit.errors import ConfigError, DataError, MissingFileError, first_line
from vlfit.index.items import IndexedItems, ItemFileError

logger = logging.getLogger(__name__)

THUMBNAIL_SIZES = (16, 1024)  # the smallest and largest ?size= of a thumbnail
CACHED_THUMBNAIL_BYTES = 256 * 1024  # larger thumbnails are made again when asked again
IMAGE_THREAD_NICENESS = 10  # added to the niceness of the threads decoding query images and thumbnails


def yield_to_text_queries() -> None:
    """Lower the CPU priority of the calling thread by ``IMAGE_THREAD_NICENESS`` (the initializer of the image
    threads; on Linux a thread's niceness is its own). Where the system does not allow it, the thread runs as is."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMAGE_THREAD_NICENESS)


class QueryImageTooLarge(DataError):
    """A query image that declares more pixels than the server decodes for a query."""


def check_query_pixels(image: bytes, max_pixels: int, name: str = "the query image") -> None:
    """Read the image's declared size from its header and refuse it beyond ``max_pixels``.

    Raises:
        QueryImageTooLarge: naming the size and the limit.
        DataError: for bytes whose header is not an image's (naming the image as ``name``).
    """
    width, height = check_image_header(image, sample_id=name)
    if width * height > max_pixels:
        raise QueryImageTooLarge(
            f"the image is {width}x{height} ({width * height / 1e6:.1f} megapixels), over the query limit of "
            f"{max_pixels / 1e6:g} megapixels (--max_query_pixels)"
        )


def check_thumbnail_size(size: int) -> None:
    """Raises ``ConfigError`` for a ``?size=`` outside ``THUMBNAIL_SIZES``."""
    low, high = THUMBNAIL_SIZES
    if not low <= size <= high:
        raise ConfigError(f"size must be between {low} and {high}, got {size}")


def thumbnail(image: bytes, size: int) -> bytes:
    """A JPEG of ``image`` whose longer side is at most ``size`` pixels (EXIF orientation applied).

    A JPEG is decoded at the smallest DCT scale whose sides stay at least ``size`` (before the rotation: a square
    request is the same either way round), never at its full size.

    Raises:
        ConfigError: for a size outside ``THUMBNAIL_SIZES``.
        DataError: for bytes that do not decode.
    """
    check_thumbnail_size(size)
    try:
        picture = decode_pil(image, sample_id="the indexed image", draft_size=size)
    except DataError as err:
        raise DataError(f"the indexed image does not decode: {err}") from err
    picture.thumbnail((size, size), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=85)
    return out.getvalue()


class ThumbnailRefused(Exception):
    """A thumbnail the server does not make: the status and the one line the client is answered."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class IndexedThumbnails:
    """Thumbnails of an index's items, and the one way an item that cannot be shown is answered.

    404: a file gone, not a regular file, or a link out of the indexed root made after the index was written (never
    followed); 422: a file that is not an image that decodes (a zip, a text file); 400: a size outside
    ``THUMBNAIL_SIZES``. The answer names the item by its number and at most its path relative to its folder, never
    the file's bytes or size; the server's log gets one WARNING naming the item, its file and the reason, once per
    item and reason.
    """

    def __init__(self) -> None:
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def make(self, items: IndexedItems, row: int, size: int) -> bytes:
        """The JPEG thumbnail of the item at ``row`` (``thumbnail``).

        Raises:
            ThumbnailRefused: with the status and message the client gets.
        """
        try:
            check_thumbnail_size(size)
        except ConfigError as err:
            raise ThumbnailRefused(400, str(err)) from None
        try:
            data = items.image_bytes(row)
        except ItemFileError as err:
            self._warn(items, row, err.path, err.detail)
            raise ThumbnailRefused(404, str(err)) from None
        except MissingFileError as err:  # no such row, or no image at hand (tar shards at URLs)
            raise ThumbnailRefused(404, str(err)) from None
        except DataError as err:  # a dataset's record that does not read: its message may name the server's files
            self._warn(items, row, None, first_line(err, 300))
            raise ThumbnailRefused(422, f"{items.name(row)}: its image cannot be read; {_FIX}") from None
        try:
            return thumbnail(data, size)
        except DataError as err:
            self._warn(items, row, items.path(items.rows[row]), _why_undecoded(err))
            message = f"{items.name(row)}: its file is not an image the server can show; {_FIX}"
            raise ThumbnailRefused(422, message) from None

    def _warn(self, items: IndexedItems, row: int, path: str | None, reason: str) -> None:
        key = (items.rows[row], reason)
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning("%s is not shown: %s: %s", items.name(row), path or "its image", reason)


_FIX = "put the image back, or index it again (vlfit retrieve index)"


def _why_undecoded(err: BaseException) -> str:
    """Why an indexed file did not decode, in words quoting none of its bytes (the decoder's message may)."""
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, UnidentifiedImageError):
        return "not an image format Pillow reads"
    if isinstance(cause, Image.DecompressionBombError):
        return "over Pillow's decompression-bomb limit"
    if isinstance(cause, DataError):
        return "not an image (empty, or no format Pillow reads)"
    return f"does not decode ({type(cause).__name__}: {first_line(cause, 200)})"


class ThumbnailCache:
    """Thumbnails by ``(generation, item, size)``, least recently used dropped first, at most ``max_bytes`` in all;
    one over ``max_item_bytes`` is not kept. Safe to share between threads.

    Args:
        max_bytes: The most bytes of thumbnails held.
        max_item_bytes: The largest thumbnail held.
    """

    def __init__(self, max_bytes: int, max_item_bytes: int = CACHED_THUMBNAIL_BYTES) -> None:
        self.max_bytes = max_bytes
        self.max_item_bytes = max_item_bytes
        self.held = 0
        self.hits = self.misses = 0
        self._items: OrderedDict[tuple[int, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int, int]) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return data

    def put(self, key: tuple[int, int, int], data: bytes) -> None:
        if len(data) > min(self.max_item_bytes, self.max_bytes):
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = data
            self.held += len(data)
            while self.held > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self.held -= len(dropped)
