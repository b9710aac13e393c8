"""A path given as ``--index`` or ``--images`` that is not what the flag takes is refused in one line saying what it
is (nothing, a file, a model, a data folder, images: ``vlfit.models.reference.folder_kind``) and the command that
takes it, where it said "no index_manifest.json" or "no image files"."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlfit.data.sources.images import ImageFolderSource
from vlfit.errors import DataError, MissingFileError
from vlfit.index.verify import open_index


def _folder(tmp_path: Path, files: dict[str, bytes]) -> Path:
    folder = tmp_path / "given"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_a_missing_index_folder_is_said_not_to_exist(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    said = rf"no such folder \({path} does not exist\); build an index there first \(vlfit retrieve index, or "
    with pytest.raises(MissingFileError, match=rf"^--index {path}: {said}vlfit.Index.build from Python\)$"):
        open_index(str(path))


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ({"config.json": b"{}"}, "a model (it holds config.json), not an index: give it as --model_name_or_path {}"),
        ({"p0.jpg": b"\xff\xd8"}, "a folder of images (it holds p0.jpg), not an index: index it with vlfit retrieve "
                                  "index --images {}"),
        ({"notes.txt": b"x"}, "no index_manifest.json in it (it holds notes.txt); build an index there first"),
    ],
)  # fmt: skip
def test_a_folder_that_is_no_index_is_refused_saying_what_it_is(tmp_path: Path, files, said: str) -> None:
    folder = _folder(tmp_path, files)
    with pytest.raises(MissingFileError) as refused:
        open_index(str(folder))
    assert str(refused.value).startswith(f"--index {folder}: {said.format(folder)}"), refused.value


def test_an_index_given_as_images_is_refused_saying_it_is_an_index(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"index_manifest.json": b"{}", "shard-00000.safetensors": b""})
    said = r"an index \(vlfit retrieve index wrote it\), not a folder of images: search it with vlfit retrieve query"
    with pytest.raises(DataError, match=rf"^--images {folder}: {said} --index {folder}$"):
        ImageFolderSource(str(folder))
