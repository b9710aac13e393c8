"""Images the server decodes, each bounded before it is decoded: query images (a pixel cap read from the header)
and thumbnails of indexed images (a DCT-scaled decode, an LRU cache of the small JPEGs they become).

A query image is checked from its header (microseconds, no pixel decoded) against ``--max_query_pixels``, far
below Pillow's 178.9-megapixel bomb limit that training data gets; the decode that follows is DCT-scaled for JPEG
(libjpeg-turbo decodes at 1/2, 1/4 or 1/8 of the size, never above what the model needs: a 40-megapixel JPEG is
decoded at about 0.6 megapixels). Formats without scaled decoding (PNG, WebP, ...) decode at full size, which the
pixel cap bounds. A thumbnail is decoded the same way (``draft`` before the EXIF rotation, so a 12000-pixel JPEG
becomes a 1500-pixel one while it is read). The threads that decode them run at a lower CPU priority than the text
queries' (``yield_to_text_queries``), so a slow decode takes the cores only when the text queries leave them.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import OrderedDict

from PIL import Image

from vlfit.data.decode import check_image_header, decode_pil
from vlfit.errors import ConfigError, DataError

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


def check_query_pixels(image: bytes, max_pixels: int) -> None:
    """Read the image's declared size from its header and refuse it beyond ``max_pixels``.

    Raises:
        QueryImageTooLarge: naming the size and the limit.
        DataError: for bytes whose header is not an image's.
    """
    width, height = check_image_header(image, sample_id="the query image")
    if width * height > max_pixels:
        raise QueryImageTooLarge(
            f"the image is {width}x{height} ({width * height / 1e6:.1f} megapixels), over the query limit of "
            f"{max_pixels / 1e6:g} megapixels (--max_query_pixels)"
        )


def thumbnail(image: bytes, size: int) -> bytes:
    """A JPEG of ``image`` whose longer side is at most ``size`` pixels (EXIF orientation applied).

    A JPEG is decoded at the smallest DCT scale whose sides stay at least ``size`` (before the rotation: a square
    request is the same either way round), never at its full size.

    Raises:
        ConfigError: for a size outside ``THUMBNAIL_SIZES``.
        DataError: for bytes that do not decode.
    """
    low, high = THUMBNAIL_SIZES
    if not low <= size <= high:
        raise ConfigError(f"size must be between {low} and {high}, got {size}")
    try:
        picture = decode_pil(image, sample_id="the indexed image", draft_size=size)
    except DataError as err:
        raise DataError(f"the indexed image does not decode: {err}") from None
    picture.thumbnail((size, size), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=85)
    return out.getvalue()


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
