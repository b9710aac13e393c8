"""Indexing an image folder reads nothing outside it: a file that is a symbolic link resolving out of the folder is
left out and counted as an unreadable file is (the report names the count and the file, the manifest lists it),
and its target is never read; a link inside the folder is indexed as its target. A folder that is a link out of the
folder is one such left-out record, never walked; one inside it is skipped (its images are there already); files
named by path follow every link."""

from __future__ import annotations

import os

import pytest

from tests.inference.several_captions import jpeg
from vlfit.data.records import BadRecordError
from vlfit.data.sources.images import ImageFilesSource, ImageFolderSource, image_files
from vlfit.index.job import IndexJob, index_collection
from vlfit.index.store import EmbeddingIndex


def test_a_link_out_of_the_indexed_folder_is_left_out_and_counted_and_one_inside_is_indexed(
    tiny_checkpoint, tmp_path
) -> None:
    images, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    (images / "trips").mkdir(parents=True)
    elsewhere.mkdir()
    for number in range(3):
        (images / "trips" / f"p{number}.jpg").write_bytes(jpeg(number))
    (images / "not-a-photo.jpg").write_bytes(b"PK\x03\x04 a zip, not an image")  # the unreadable file of today
    (elsewhere / "private.jpg").write_bytes(jpeg(5))  # a good JPEG: read, it would be indexed
    os.symlink(elsewhere / "private.jpg", images / "trips" / "outside.jpg")
    os.symlink(images / "trips" / "p0.jpg", images / "inside.jpg")

    report = index_collection(IndexJob(str(tiny_checkpoint), str(tmp_path / "index"), images=str(images),
                                       progress=False, index_type="flat"))  # fmt: skip

    outside = str(images / "trips" / "outside.jpg")
    left_out = {bad["id"]: bad["reason"] for bad in report.bad_samples}
    assert set(left_out) == {outside, str(images / "not-a-photo.jpg")}
    assert "link out of the indexed folder" in left_out[outside] and "private" not in left_out[outside]
    lines = report.lines()
    assert f"left out {outside}: cannot read image file: it is a link out of the indexed folder" in "\n".join(lines)
    assert "4 added, 2 left out" in lines[-1]
    indexed = EmbeddingIndex(str(tmp_path / "index"))
    assert str(images / "inside.jpg") in indexed.ids() and outside not in indexed.ids()
    assert outside in {bad["id"] for bad in indexed.manifest.bad_samples}


def test_a_folder_linked_from_out_of_the_indexed_folder_is_left_out_and_counted_not_lost(tmp_path) -> None:
    images, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    (images / "trips").mkdir(parents=True)
    (elsewhere / "holiday").mkdir(parents=True)
    (images / "trips" / "p0.jpg").write_bytes(jpeg(0))
    (elsewhere / "holiday" / "secret.jpg").write_bytes(jpeg(1))
    os.symlink(elsewhere / "holiday", images / "holiday")  # out: one left-out record, its files never listed
    os.symlink(images / "trips", images / "again")  # inside: its images are listed once, as trips/
    os.symlink(images, images / "trips" / "loop")  # a link back up: walked once
    assert image_files(str(images)) == ["holiday/", "trips/p0.jpg"]
    source = ImageFolderSource(str(images))
    with pytest.raises(BadRecordError, match="^sample holiday/: cannot read image folder: it is a link out of the"):
        source[0]
    named = ImageFilesSource([str(images)])  # a folder named by its path: every link is the caller's own
    assert [os.path.relpath(path, images) for path in named.paths] == ["holiday/secret.jpg", "trips/p0.jpg"]
