"""Thumbnails of indexed files that cannot be shown, on the real ``vlfit serve`` process: a photo replaced by a link
to a file that is not an image, or by a zip, is 422; by a link resolving out of the indexed root made after the
index was written, 404 without its target being read; a link inside the root is shown. Each answer names the item
(its number and its path relative to the folder) and none of the file's bytes or its size, and the server's log
warns once per item, naming the file.

One server for the module, on a free loopback port, stopped by the module; every request has a timeout."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.inference.several_captions import jpeg

pytestmark = pytest.mark.slow

START_TIMEOUT = 120
TIMEOUT = 30
NOTES = b"private notes of the operator, never to be served: hunter2 " * 8


@contextmanager
def folder_server(model: Path, images: Path, folder: Path, prepare=None) -> Iterator[tuple[str, Path, list[str]]]:
    """``vlfit serve`` of an index of ``images`` built with ``model`` (``prepare()`` runs between the build and the
    start): its base URL, its log, and the index's item ids by row."""
    import vlfit
    from vlfit.index.store import EmbeddingIndex
    from vlfit.serve.launch import kill_process_tree, start_server

    vlfit.Index.build(str(model), str(folder / "index"), images=str(images), index_type="flat")
    rows = EmbeddingIndex(str(folder / "index")).row_ids
    if prepare is not None:
        prepare()
    log = folder / "server.log"
    flags = ["--index", str(folder / "index"), "--reload_interval", "0"]
    server = start_server(flags, str(log), timeout=START_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        yield server.url, log, rows
    finally:
        kill_process_tree(server.process)


def _zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes.txt", NOTES)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """The folder ``photos`` (p0..p3.jpg) indexed, then: p0 a link to a photo inside the folder, p1 a link to a
    text file inside it, p2 a zip, p3 a link to a good JPEG outside the folder."""
    root = tmp_path_factory.mktemp("image-errors")
    images, elsewhere = root / "photos", root / "elsewhere"
    images.mkdir()
    elsewhere.mkdir()
    for number in range(4):
        (images / f"p{number}.jpg").write_bytes(jpeg(number))

    def replace_photos() -> None:
        (images / "kept").mkdir()
        os.replace(images / "p0.jpg", images / "kept" / "p0.jpg")
        os.symlink(images / "kept" / "p0.jpg", images / "p0.jpg")
        (images / "notes.txt").write_bytes(NOTES)
        os.remove(images / "p1.jpg")
        os.symlink(images / "notes.txt", images / "p1.jpg")
        (images / "p2.jpg").write_bytes(_zip())
        (elsewhere / "private.jpg").write_bytes(jpeg(6))
        os.remove(images / "p3.jpg")
        os.symlink(elsewhere / "private.jpg", images / "p3.jpg")

    with folder_server(tiny_checkpoint, images, root, replace_photos) as (base, log, rows):
        yield base, log, {Path(item).name: row for row, item in enumerate(rows)}, images


def _thumbnail(base: str, row: int) -> httpx.Response:
    return httpx.get(f"{base}/api/image/{row}?size=32", timeout=TIMEOUT)


def _shows_nothing_of(answer: httpx.Response, data: bytes, images: Path) -> None:
    """The answer quotes none of ``data`` (its first bytes, raw or as Python writes them) nor its size, nor the
    server's folders."""
    body = answer.content
    for start in (data[:4], data[:8], repr(data[:8])[2:-1].encode()):
        assert start not in body
    assert str(len(data)).encode() not in body and str(images).encode() not in body


def _warned(log: Path, row: int, name: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if "WARNING" in line and f"item {row} ({name})" in line]


def test_a_link_to_a_file_that_is_not_an_image_is_422_naming_the_item_not_the_file(server) -> None:
    base, log, rows, images = server
    row = rows["p1.jpg"]
    answers = [_thumbnail(base, row), _thumbnail(base, row)]
    for answer in answers:
        assert answer.status_code == 422
        assert answer.json()["error"].startswith(f"item {row} (p1.jpg): its file is not an image")
        _shows_nothing_of(answer, NOTES, images)
    (warning,) = _warned(log, row, "p1.jpg")  # once per item, not per request
    assert str(images / "p1.jpg") in warning and "not an image format" in warning


def test_a_zip_in_place_of_a_photo_is_422_naming_the_item_not_the_file(server) -> None:
    base, log, rows, images = server
    row = rows["p2.jpg"]
    for answer in (_thumbnail(base, row), _thumbnail(base, row)):
        assert answer.status_code == 422 and f"item {row} (p2.jpg)" in answer.json()["error"]
        _shows_nothing_of(answer, _zip(), images)
    (warning,) = _warned(log, row, "p2.jpg")
    assert str(images / "p2.jpg") in warning and "not an image format" in warning


def test_a_link_out_of_the_indexed_root_is_404_and_its_target_is_never_shown(server) -> None:
    base, log, rows, images = server
    row = rows["p3.jpg"]
    for answer in (_thumbnail(base, row), _thumbnail(base, row)):
        assert answer.status_code == 404  # the target is a good JPEG: read, it would be shown
        error = answer.json()["error"]
        assert error.startswith(f"item {row} (p3.jpg): its file is a link out of the indexed root")
        assert "private" not in error
        _shows_nothing_of(answer, jpeg(6), images)
    (warning,) = _warned(log, row, "p3.jpg")
    assert str(images / "p3.jpg") in warning and "private.jpg, out of the indexed root" in warning


def test_a_link_inside_the_indexed_root_is_shown(server) -> None:
    base, log, rows, _ = server
    answer = _thumbnail(base, rows["p0.jpg"])
    assert answer.status_code == 200 and answer.content[:2] == b"\xff\xd8"
    assert not _warned(log, rows["p0.jpg"], "p0.jpg")
