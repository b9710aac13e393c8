"""Where an index's items come from: the image of an item by its row, and (an index built before items had
captions) the caption of its record. What ``vlfit serve`` shows as thumbnails and what re-ranking scores
(``vlfit.index.rerank``) are read here, one way.

An image folder's items are files (their ids are absolute paths); a dataset split's items are looked up in the
split, opened again from the manifest's ``collections`` (ids only: no image is read until one is asked for). Tar
shards at URLs are not fetched again: their items have ids and captions, no image at hand.
"""

from __future__ import annotations

import logging
import os

from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.openers import COLLECTION_KEYS, open_collection
from vlfit.errors import MissingFileError
from vlfit.index.store import EmbeddingIndex

logger = logging.getLogger(__name__)


class IndexedItems:
    """The images (and record captions) of an index's items.

    Args:
        index: The index; its manifest's collections are opened again (a dataset that moved is logged in one line
            and its items have no image at hand).
    """

    def __init__(self, index: EmbeddingIndex) -> None:
        self.rows: list[str] = index.row_ids
        self.captions: dict[str, str | None] = {}  # an older index's items: the record's caption, from the dataset
        self._dataset_rows: dict[str, tuple[int, int]] = {}  # item -> (source, row)
        self._sources: list[ImageTextSource] = []
        self.folder_items = False  # some items are image files
        for collection in index.manifest.collections:
            if collection.get("images"):
                self.folder_items = True
            elif collection.get("dataset_name") and not collection.get("streamed"):
                self._add(collection)

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

    def image_bytes(self, row: int) -> bytes:
        """The encoded image of the item at ``row``.

        Raises:
            MissingFileError: for a row that is not in the index, or an image that is no longer there or that the
                index cannot reach (tar shards at URLs).
        """
        if not 0 <= row < len(self.rows):
            raise MissingFileError(f"no item {row} in the index ({len(self.rows)} items)")
        item = self.rows[row]
        if item in self._dataset_rows:
            number, position = self._dataset_rows[item]
            return self._sources[number][position].image
        if self.path(item) is not None:
            try:
                with open(item, "rb") as f:
                    return f.read()
            except OSError:
                raise MissingFileError(f"item {row}: its image file is gone") from None
        raise MissingFileError(f"item {row}: the index does not say where its image is")


__all__ = ["IndexedItems"]
