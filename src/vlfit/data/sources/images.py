"""Image files as a map-style source: every image under a folder (``ImageFolderSource``: what ``retrieve index
--images`` embeds) or files and folders given by path (``ImageFilesSource``: what ``vlfit classify`` reads). They
have no captions: each image's caption is its path, which nothing embeds.

A folder's files are the user's, linked or not: a file that is a symbolic link (to a photo kept elsewhere, the
common way to assemble a dataset) is read as its target and indexed under its path in the folder, and a folder that
is a link out of the folder is walked, its images under their paths through the link. A link to a folder inside the
folder is skipped (its images are listed under their own paths), a folder reached twice (a link back up) is walked
once, and a link to a folder holding the indexed one (a loop that would walk everything beside it) is not walked: it
is one bad record naming it (``name/``), left out and counted as an unreadable file is. What ``vlfit serve`` shows
of an indexed folder is limited to the files the index recorded (``vlfit.index.items``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from vlfit.data.records import BadRecordError, Record
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import DataError, MissingFileError
from vlfit.models.reference import IMAGE_EXTENSIONS, folder_kind, is_image_file


def image_files(root: str) -> list[str]:
    """The image files under a folder (recursively, not hidden), as sorted ``/``-separated paths relative to it.

    A folder in it that is a symbolic link is walked when it resolves out of ``root``, and not when it resolves
    inside it (its images are listed under their own paths). One resolving to a folder that holds ``root`` is listed
    as itself (``name/``), never walked, so reading it is a bad record naming it. A folder reached twice (a link back
    up) is walked once.
    """
    inside = os.path.realpath(root)
    paths: list[str] = []
    walked: set[str] = set()

    def walk(folder: str, relative: str) -> None:
        real = os.path.realpath(folder)
        if real in walked:
            return
        walked.add(real)
        with os.scandir(folder) as entries:
            for entry in entries:
                path = relative + entry.name
                if entry.is_dir():  # a link to a folder too
                    target = os.path.realpath(entry.path) if entry.is_symlink() else None
                    if target is not None and _within(target, inside):
                        continue
                    if target is not None and _within(inside, target):
                        paths.append(path + "/")
                        continue
                    walk(entry.path, path + "/")
                elif is_image_file(entry.name):
                    paths.append(path)  # a broken link too: reading it says so

    walk(root, "")
    return sorted(paths)


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _read_image_file(path: str, sample_id: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise BadRecordError(f"sample {sample_id}: cannot read image file: {err.strerror}") from err


class ImageFolderSource(ImageTextSource):
    """Every image file under a folder (recursively, in sorted path order); ids are paths relative to it, image ids
    their absolute paths (each file is an image of its own, its ``item_folder``'s), captions the ids.

    Args:
        root: The folder.

    Raises:
        MissingFileError: when ``root`` is not a folder.
        DataError: when it holds no image files (naming what it is instead: a model, an index, data ...).
    """

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise MissingFileError(f"--images {root}: no such folder")
        paths = image_files(root)
        if not paths:
            found = folder_kind(root)
            if found.kind not in ("images", "other"):  # a model, an index, data ...: say so, and what takes it
                raise DataError(f"--images {root}: {found.what}, not a folder of images{found.use_after(': ')}")
            raise DataError(f"--images {root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in it")
        self.root = root
        self.paths = paths
        self.captioned = False
        self.item_folder = os.path.abspath(root)
        super().__init__(name=f"image folder {root}", column_names=["image"], num_rows=len(self.paths))

    def _read(self, row: int) -> Record:
        path = self.paths[row]
        full = os.path.join(self.root, path)
        if path.endswith("/"):  # image_files lists a link to a folder holding the folder as itself
            raise BadRecordError(
                f"sample {path}: cannot read image folder: it is a link to a folder holding the indexed folder "
                f"{self.root} (a loop), not walked (link its images' folders instead)"
            )
        image = _read_image_file(full, path)
        return Record(id=path, image=image, caption=path, image_id=os.path.join(self.item_folder, path))

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self.paths[int(row)] for row in self._positions(rows)]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self.paths[int(row)] for row in self._positions(rows)]

    def _read_image_ids(self, rows: np.ndarray | None) -> list[str | None]:
        return [os.path.join(self.item_folder, self.paths[int(row)]) for row in self._positions(rows)]  # type: ignore[arg-type]


class ImageFilesSource(ImageTextSource):
    """Image files given by path, and every image file under the folders given (in sorted order); each id is the
    file's path as given (a folder's files joined to it).

    Args:
        paths: Files and folders.

    Raises:
        FileNotFoundError: when a path does not exist.
        ValueError: when no image file is given or found.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        files: list[str] = []
        for path in paths:
            if os.path.isdir(path):
                files.extend(os.path.join(path, name) for name in image_files(path))
            elif os.path.isfile(path):
                files.append(path)
            else:
                raise MissingFileError(f"{path}: no such image file or folder")
        if not files:
            raise DataError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(paths) or 'no path given'}")
        self.paths = files
        super().__init__(name=f"{len(files)} image files", column_names=["image"], num_rows=len(files))

    def _read(self, row: int) -> Record:
        path = self.paths[row]
        return Record(id=path, image=_read_image_file(path, path), caption=path)

    def _read_captions(self, rows: np.ndarray | None) -> list[str | None]:
        return [self.paths[int(row)] for row in (range(len(self.paths)) if rows is None else rows)]

    def _read_ids(self, rows: np.ndarray | None) -> list[str]:
        return [self.paths[int(row)] for row in self._positions(rows)]
