"""Where an index's items come from: the image of an item by its row, and (an index built before items had
captions) the caption of its record. What ``vlfit serve`` shows as thumbnails and what re-ranking scores
(``vlfit.index.rerank``) are read here, one way.

An image folder's items are files (their ids are absolute paths); a dataset split's items are looked up in the
split, opened again from the manifest's ``collections`` (ids only: no image is read until one is asked for). Tar
shards at URLs are not fetched again: their items have ids and captions, no image at hand.

A folder's file is read only while it is a regular file the index recorded: its path in the folder the index was
built from, resolving inside that folder, or out of it through symbolic links that were there when the index was
last written (a dataset assembled from links to photos kept elsewhere, which ``vlfit retrieve index`` indexes). A
photo replaced since by a link resolving elsewhere (``/etc/...``, another user's home), or reached through such a
link anywhere on the way, is refused without opening its target (``ItemFileError``); a link swapped inside the
folder to a file that is not an image is refused by the decoder, without its bytes (``vlfit.serve.images``). Errors
name the item by its number and its path relative to its folder, never the file's content.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.openers import COLLECTION_KEYS, open_collection
from vlfit.errors import MissingFileError
from vlfit.index.store import EmbeddingIndex

logger = logging.getLogger(__name__)


class ItemFileError(MissingFileError):
    """An image folder's item whose file cannot be read: gone, not a regular file, or a link out of its folder.

    The message names the item (its number and its path relative to its folder) and what to do, for the client;
    ``path`` and ``detail`` name the file and what was found there, for the server's log.
    """

    def __init__(self, message: str, path: str, detail: str) -> None:
        super().__init__(message)
        self.path = path
        self.detail = detail


class IndexedItems:
    """The images (and record captions) of an index's items.

    Args:
        index: The index; its manifest's collections are opened again (a dataset that moved is logged in one line
            and its items have no image at hand).
        stamp: The stamp of its manifest as the caller read it (``vlfit.index.verify.manifest_stamp``): when the
            index was last written; a link made since (or in the same clock tick: file times are coarse) is none the
            index recorded (None: no manifest on disk, every link out of its folder refused).
    """

    def __init__(self, index: EmbeddingIndex, stamp: tuple[int, int] | None) -> None:
        self.rows: list[str] = index.row_ids
        self.captions: dict[str, str | None] = {}  # an older index's items: the record's caption, from the dataset
        self._dataset_rows: dict[str, tuple[int, int]] = {}  # item -> (source, row)
        self._sources: list[ImageTextSource] = []
        self.folder_items = False  # some items are image files
        roots: set[str] = set()
        for collection in index.manifest.collections:
            if collection.get("images"):
                self.folder_items = True
                roots.add(collection["images"])
            elif collection.get("dataset_name") and not collection.get("streamed"):
                self._add(collection)
        self.roots = sorted(roots, key=len, reverse=True)  # the folders indexed, the innermost first
        self.written_ns = stamp[0] if stamp else None  # when the index was last written

    def _add(self, collection: dict) -> None:
        try:
            source, _ = open_collection(**{k: collection[k] for k in COLLECTION_KEYS if k in collection})
        except (OSError, ValueError) as err:  # the dataset moved: its items come without captions or images
            logger.warning("cannot open %s to show captions and images: %s", collection["dataset_name"], err)
            return
        number = len(self._sources)
        self._sources.append(source)  # type: ignore[arg-type]
        captions, image_ids = source.captions(), source.image_ids()
        for row, record_id in enumerate(source.ids()):  # ids, not records: no image is read here
            self.captions.setdefault(record_id, captions[row])
            self._dataset_rows.setdefault(record_id, (number, row))
            if image_ids[row] is not None:  # an item of an image id: its image is any of its records'
                self._dataset_rows.setdefault(image_ids[row], (number, row))  # type: ignore[arg-type]

    @property
    def has_images(self) -> bool:
        """Some items' images can be read (an image folder, or a dataset split that opened)."""
        return self.folder_items or bool(self._sources)

    def path(self, item: str) -> str | None:
        """The file of an image folder's item (None for a dataset's)."""
        return item if self.folder_items and os.path.isabs(item) else None

    def root(self, item: str) -> str | None:
        """The indexed folder an image folder's item is in (None: in none the manifest lists)."""
        return next((root for root in self.roots if item.startswith(os.path.join(root, ""))), None)

    def name(self, row: int) -> str:
        """The item at ``row`` as messages name it: ``item 3 (trips/p1.jpg)``, a folder's file by its path relative
        to the folder (a dataset's item by its id)."""
        item = self.rows[row]
        root = self.root(item) if self.path(item) is not None else None
        return f"item {row} ({os.path.relpath(item, root) if root else item})"

    def image_bytes(self, row: int) -> bytes:
        """The encoded image of the item at ``row``.

        Raises:
            ItemFileError: for a folder's file that is gone, is not a regular file, or is a link resolving out of
                the folder indexed (its target is never opened).
            MissingFileError: for a row that is not in the index, or an image that the index cannot reach (tar
                shards at URLs).
            DataError: for a dataset's record that cannot be read.
        """
        if not 0 <= row < len(self.rows):
            raise MissingFileError(f"no item {row} in the index ({len(self.rows)} items)")
        item = self.rows[row]
        if item in self._dataset_rows:
            number, position = self._dataset_rows[item]
            return self._sources[number][position].image
        if self.path(item) is not None:
            return self._file_bytes(row, item)
        raise MissingFileError(f"item {row}: the index does not say where its image is")

    def _file_bytes(self, row: int, path: str) -> bytes:
        """The bytes of a folder's file, read only when it is a regular file the index recorded: resolving inside its
        folder, or out of it through links no newer than the index."""
        root = self.root(path)
        fix = "put the photo back, or index the folder again (vlfit retrieve index)"
        if root is None:
            raise ItemFileError(f"{self.name(row)}: its file is in no folder the index was built from; {fix}", path,
                                "in no folder the index lists")  # fmt: skip
        try:
            resolved, newest_link = _resolve(path)
        except OSError as err:
            what = "gone" if isinstance(err, FileNotFoundError) else f"unreadable ({err.strerror})"
            raise ItemFileError(f"{self.name(row)}: its image file is {what}; {fix}", path, what) from None
        inside = os.path.realpath(root)
        if os.path.commonpath([resolved, inside]) != inside and (
            self.written_ns is None or newest_link >= self.written_ns
        ):
            detail = f"a link to {resolved}, out of the indexed root {root}, newer than the index: not read"
            raise ItemFileError(f"{self.name(row)}: its file is a link out of the indexed root made after the index "
                                f"was written, not followed; {fix}", path, detail)  # fmt: skip
        try:
            # O_NOFOLLOW: the resolved path's last part is not swapped for a link between the check and the read
            fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as err:
            what = "gone" if isinstance(err, FileNotFoundError) else f"unreadable ({err.strerror})"
            raise ItemFileError(f"{self.name(row)}: its image file is {what}; {fix}", path, what) from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a folder, a pipe, a device: never read
                raise ItemFileError(f"{self.name(row)}: its file is not a regular file; {fix}", path,
                                    "not a regular file")  # fmt: skip
            try:
                return f.read()
            except OSError as err:
                raise ItemFileError(f"{self.name(row)}: its image file is unreadable; {fix}", path,
                                    f"unreadable ({err.strerror})") from None  # fmt: skip


_MAX_LINKS = 40  # as many links as Linux follows resolving one path (ELOOP beyond)


def _resolve(path: str) -> tuple[str, int]:
    """``path`` resolved as ``os.path.realpath`` resolves it, and the newest change time (``st_ctime_ns``) of the
    symbolic links met on the way (0: none). A link cannot be pointed elsewhere in place: one made or replaced
    since a time has a change time after it.

    Raises:
        OSError: for a part of the path that is gone, or too many links (a loop).
    """
    newest, followed = 0, 0
    pending = [part for part in os.path.abspath(path).split(os.sep) if part]
    pending.reverse()
    resolved = os.sep
    while pending:
        part = pending.pop()
        if part == ".":
            continue
        if part == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, part)
        status = os.lstat(candidate)
        if not stat.S_ISLNK(status.st_mode):
            resolved = candidate
            continue
        followed += 1
        if followed > _MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        newest = max(newest, status.st_ctime_ns)
        target = os.readlink(candidate)
        if os.path.isabs(target):
            resolved = os.sep
        pending.extend(reversed([part for part in target.split(os.sep) if part]))
    return resolved, newest


__all__ = ["IndexedItems", "ItemFileError"]
