"""An image folder's files are the user's, linked or not: a file that is a symbolic link to a photo kept elsewhere is
indexed under its path in the folder (a folder of nothing but links indexes every photo), and a folder that is a
link out of the folder is walked. A link to a folder inside it is skipped (its images are there already), a link
back up is walked once, and a link to a folder holding the indexed one is one left-out record, never walked; files
named by path list the same. What the index's items show (``IndexedItems``: the server's thumbnails, re-ranking) is
limited to the files the index recorded: a link made after the index was written, out of the folder, is refused
without its target being read, and a photo swapped for a link to a file that is not an image is no thumbnail."""

from __future__ import annotations

import os

import pytest

from tests.inference.several_captions import jpeg
from vlfit.data.records import BadRecordError
from vlfit.data.sources.images import ImageFilesSource, ImageFolderSource, image_files
from vlfit.index.items import IndexedItems, ItemFileError
from vlfit.index.job import IndexJob, index_collection
from vlfit.index.store import EmbeddingIndex
from vlfit.index.verify import manifest_stamp
from vlfit.serve.images import IndexedThumbnails, ThumbnailRefused


def _index(model, images, folder) -> tuple[object, EmbeddingIndex]:
    report = index_collection(IndexJob(str(model), str(folder), images=str(images), progress=False,
                                       index_type="flat"))  # fmt: skip
    return report, EmbeddingIndex(str(folder))


def test_a_folder_of_links_to_photos_kept_elsewhere_indexes_every_photo_under_its_path_in_the_folder(
    tiny_checkpoint, tmp_path
) -> None:
    images, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    (images / "trips").mkdir(parents=True)
    elsewhere.mkdir()
    for number in range(3):
        (elsewhere / f"e{number}.jpg").write_bytes(jpeg(number))
        os.symlink(elsewhere / f"e{number}.jpg", images / "trips" / f"p{number}.jpg")
    os.symlink(images / "trips" / "p0.jpg", images / "inside.jpg")  # a link to a link inside the folder
    (images / "not-a-photo.jpg").write_bytes(b"PK\x03\x04 a zip, not an image")

    report, indexed = _index(tiny_checkpoint, images, tmp_path / "index")

    linked = [str(images / "trips" / f"p{number}.jpg") for number in range(3)]
    assert sorted(indexed.ids()) == sorted([*linked, str(images / "inside.jpg")])
    assert [bad["id"] for bad in report.bad_samples] == [str(images / "not-a-photo.jpg")]
    assert "4 added, 1 left out" in report.lines()[-1]
    items = IndexedItems(indexed, manifest_stamp(indexed.path))
    for number, path in enumerate(linked):  # the photo the link leads to, as the index embedded it
        assert items.image_bytes(indexed.row_ids.index(path)) == jpeg(number)


def test_links_made_after_the_index_was_written_show_nothing_out_of_the_folder(tiny_checkpoint, tmp_path) -> None:
    images, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    images.mkdir()
    elsewhere.mkdir()
    for number in range(3):
        (images / f"p{number}.jpg").write_bytes(jpeg(number))
    (elsewhere / "private.jpg").write_bytes(jpeg(6))  # a good JPEG: read, it would be shown
    (elsewhere / "e3.jpg").write_bytes(jpeg(3))
    os.symlink(elsewhere / "e3.jpg", images / "p3.jpg")
    (images / "notes.txt").write_text("private notes, never to be shown")
    _, indexed = _index(tiny_checkpoint, images, tmp_path / "index")
    rows = {os.path.basename(item): row for row, item in enumerate(indexed.row_ids)}

    os.remove(images / "p0.jpg")  # a photo swapped for a link out of the folder
    os.symlink(elsewhere / "private.jpg", images / "p0.jpg")
    os.remove(images / "p3.jpg")  # a link the index recorded, swapped for one to another file
    os.symlink(elsewhere / "private.jpg", images / "p3.jpg")
    os.remove(images / "p1.jpg")  # a photo swapped for a link inside the folder to a file that is not an image
    os.symlink(images / "notes.txt", images / "p1.jpg")

    items = IndexedItems(indexed, manifest_stamp(indexed.path))
    for name in ("p0.jpg", "p3.jpg"):
        made_after = rf"^item {rows[name]} \({name}\): its file is a link out of the indexed root made after the index"
        with pytest.raises(ItemFileError, match=made_after):
            items.image_bytes(rows[name])
    with pytest.raises(ThumbnailRefused, match="its file is not an image the server can show") as refused:
        IndexedThumbnails().make(items, rows["p1.jpg"], 32)
    assert refused.value.status == 422 and "private" not in str(refused.value)
    assert items.image_bytes(rows["p2.jpg"]) == jpeg(2)


def test_a_folder_linked_from_out_of_the_indexed_folder_is_walked_and_a_loop_is_not(tmp_path) -> None:
    images, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    (images / "trips").mkdir(parents=True)
    (elsewhere / "holiday").mkdir(parents=True)
    (images / "trips" / "p0.jpg").write_bytes(jpeg(0))
    (elsewhere / "holiday" / "h0.jpg").write_bytes(jpeg(1))
    os.symlink(elsewhere / "holiday", images / "holiday")  # out: walked, its images under holiday/
    os.symlink(images / "trips", images / "again")  # inside: its images are listed once, as trips/
    os.symlink(images, images / "trips" / "loop")  # a link back up: walked once
    os.symlink(tmp_path, images / "up")  # a folder holding the indexed one: never walked
    assert image_files(str(images)) == ["holiday/h0.jpg", "trips/p0.jpg", "up/"]
    source = ImageFolderSource(str(images))
    assert source[0].image == jpeg(1) and source[0].id == "holiday/h0.jpg"
    with pytest.raises(BadRecordError, match="^sample up/: cannot read image folder: it is a link to a folder holding"):
        source[2]
    named = ImageFilesSource([str(images)])  # a folder named by its path lists the same
    assert [os.path.relpath(path, images) for path in named.paths] == ["holiday/h0.jpg", "trips/p0.jpg", "up"]
