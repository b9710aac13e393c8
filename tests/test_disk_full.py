"""A disk that fills during ``vlfit retrieve index``, ``vlfit export`` or ``vlfit prepare`` ends the command in one
line naming the folder, about the space needed and what was kept; the index and the prepared shards resume to what
a clean run makes, and an earlier export in the folder is left as it was.

The full disk is simulated where the bytes are written: ``builtins.open`` is wrapped so that the files opened for
writing under one folder share a budget of bytes, and a ``write`` past it raises ``OSError(ENOSPC)`` as a full
device does (no file name, the bytes that fit written). pyarrow writes a parquet shard without ``builtins.open``:
one shard of ``vlfit prepare`` is written into /dev/full instead, pyarrow's own error. (``vlfit train``'s full disk
is tested in tests/training/test_atomic_checkpoints.py.)
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.inference.tiny_models import write_image_folder
from vlfit.atomic_files import STAGING_NAME, write_text_atomically
from vlfit.cli import main
from vlfit.errors import error_chain, failed_write_error, format_bytes
from vlfit.index.store import EmbeddingIndex
from vlfit.inference.exported import graph_name

WRITE_MODES = frozenset("wax+")


class SmallDisk:
    """The files written under ``folder`` share ``free`` bytes (None: no limit); every write is recorded.

    Attributes:
        writes: ``(path relative to folder, bytes)`` of each write, in order.
    """

    def __init__(self, folder: Path, free: int | None = None) -> None:
        self.folder = os.path.join(os.path.abspath(folder), "")
        self.free = free
        self.writes: list[tuple[str, int]] = []
        self._open = builtins.open

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = self._open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and WRITE_MODES & set(mode):
            path = os.path.abspath(os.fspath(file))
            if path.startswith(self.folder):
                return _LimitedFile(opened, self, os.path.relpath(path, self.folder))
        return opened

    def take(self, name: str, size: int) -> int:
        """Record a write of ``size`` bytes to ``name``; returns how many fit."""
        self.writes.append((name, size))
        if self.free is None:
            return size
        fits = min(size, self.free)
        self.free -= fits
        return fits


class _LimitedFile:
    """A file opened for writing on a ``SmallDisk``: a write past the disk's free bytes writes what fits, then
    raises ENOSPC."""

    def __init__(self, file: Any, disk: SmallDisk, name: str) -> None:
        self._file, self._disk, self._name = file, disk, name

    def write(self, data: Any) -> int:
        raw = data.encode() if isinstance(data, str) else memoryview(data).cast("B")
        fits = self._disk.take(self._name, len(raw))
        if fits < len(raw):
            self._file.write(raw[:fits] if not isinstance(data, str) else data[:fits])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._file.write(data)

    def __enter__(self) -> _LimitedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


def _temporary_files(folder: Path) -> list[str]:
    return [name for _, _, names in os.walk(folder) for name in names if name.endswith(".tmp")]


def test_an_atomic_write_that_fills_the_disk_names_its_file_and_leaves_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "manifest.json"
    target.write_text("old\n")
    monkeypatch.setattr(builtins, "open", SmallDisk(tmp_path, free=3).open)
    with pytest.raises(OSError) as raised:
        write_text_atomically(str(target), "a longer new text\n", durable=True)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    monkeypatch.undo()
    assert target.read_text() == "old\n" and not _temporary_files(tmp_path)


def test_a_full_disk_hidden_by_raise_from_none_is_still_one_line_and_a_stream_stops_the_chain_there(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("serialization failed") from None
    except RuntimeError as caught:
        error = caught
    assert [type(link) for link in error_chain(error)] == [RuntimeError, OSError]
    assert [type(link) for link in error_chain(error, follow_suppressed=False)] == [RuntimeError]
    assert "no space left on the device of" in str(failed_write_error(error, str(tmp_path)))


@pytest.fixture(scope="module")
def few_images(synthetic_dataset_dir, tmp_path_factory) -> Path:
    return write_image_folder(synthetic_dataset_dir, tmp_path_factory.mktemp("images"))


def _index(model: Path, images: Path, out: Path) -> int:
    return main(["retrieve", "index", "--model", str(model), "--images", str(images), "--output_dir", str(out),
                 "--batch_size", "4", "--shard_size", "4", "--disable_tqdm", "true"])  # fmt: skip


@pytest.mark.slow
def test_retrieve_index_on_a_full_disk_ends_in_one_line_and_resumes(
    tiny_checkpoint, few_images, tmp_path, monkeypatch, capsys
):
    """The disk fills while the second shard's embeddings are written: exit 2 and one line naming the index folder,
    the file, about the shard's size (rows x embedding size x 4 bytes) and that the index keeps the shards its
    manifest lists; the index opens with the first shard, and the same command run again completes it into the
    index a clean build makes."""
    clean = SmallDisk(tmp_path / "clean")
    monkeypatch.setattr(builtins, "open", clean.open)
    assert _index(tiny_checkpoint, few_images, tmp_path / "clean") == 0
    monkeypatch.undo()
    expected = EmbeddingIndex(str(tmp_path / "clean"))
    names = [name for name, _ in clean.writes]
    second = next(i for i, name in enumerate(names) if name.startswith(".shard-00001.safetensors."))
    before = sum(size for _, size in clean.writes[:second])  # the bytes written before the second shard

    out = tmp_path / "index"
    monkeypatch.setattr(builtins, "open", SmallDisk(out, free=before + 64).open)
    capsys.readouterr()
    assert _index(tiny_checkpoint, few_images, out) == 2
    monkeypatch.undo()
    line = _error_line(capsys)
    first, second_shard = expected.manifest.shards[:2]
    shard_bytes = second_shard["count"] * expected.manifest.identity.embedding_size * 4
    assert line.startswith(f"vlfit retrieve: error: no space left on the device of {out} writing "
                           f"{out / 'shard-00001.safetensors'} (")  # fmt: skip
    assert f"free, about {format_bytes(shard_bytes)} needed); the index keeps every shard its manifest lists" in line
    assert line.endswith("free space there and run the same command again to resume")
    assert not _temporary_files(out)
    assert EmbeddingIndex(str(out)).ids() == expected.shard_ids(first)  # the first shard, listed

    assert _index(tiny_checkpoint, few_images, out) == 0
    resumed = EmbeddingIndex(str(out))
    assert resumed.ids() == expected.ids()
    assert resumed.embeddings().equal(expected.embeddings())


def _needed_bytes(line: str) -> float:
    """The ``about N <unit> needed`` of a full disk's message, in bytes."""
    number, unit = line.split(" needed")[0].rsplit("about ", 1)[1].split(" ")
    return float(number.replace(",", "")) * {"MB": 1e6, "kB": 1e3, "bytes": 1}[unit]


def _digests(folder: Path) -> dict[str, str]:
    return {
        os.path.relpath(os.path.join(root, name), folder): hashlib.sha256(Path(root, name).read_bytes()).hexdigest()
        for root, _, names in os.walk(folder)
        for name in names
    }


@pytest.mark.slow
def test_export_on_a_full_disk_ends_in_one_line_and_replaces_nothing(
    tiny_checkpoint, onnx_export, tmp_path, monkeypatch, capsys
):
    """Exporting over an earlier export, the disk fills while the first graph is staged: exit 2 and one line naming
    the folder and about what the graphs need; the earlier export is as it was and the staging folder is gone."""
    out = tmp_path / "export"
    shutil.copytree(onnx_export, out)
    earlier = _digests(out)
    image_graph = os.path.getsize(out / graph_name("image", "fp32", "onnx"))
    monkeypatch.setattr(builtins, "open", SmallDisk(out, free=1000).open)
    capsys.readouterr()
    assert main(["export", "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(out),
                 "--parity_samples", "2"]) == 2  # fmt: skip
    monkeypatch.undo()
    line = _error_line(capsys)
    assert line.startswith(f"vlfit export: error: no space left on the device of {out} (")
    graphs = image_graph + os.path.getsize(out / graph_name("text", "fp32", "onnx"))
    assert graphs / 2 <= _needed_bytes(line) <= 3 * graphs  # the two fp32 graphs, roughly
    assert line.endswith(f"; nothing in {out} was replaced (the export is staged in {STAGING_NAME} and moved in "
                         "once complete): free space there or export elsewhere (--output_dir)")  # fmt: skip
    assert _digests(out) == earlier


@pytest.mark.slow
def test_a_full_disk_while_the_ann_structure_is_written_ends_in_one_line_and_the_rerun_builds_it(
    tiny_checkpoint, few_images, tmp_path, monkeypatch, capsys
):
    """Every shard is written and listed, then the disk fills while ``ann.faiss`` is written: exit 2 and one line
    naming the file, about its size and that the shards are kept (queries scan them); the index opens with every
    row, no temporary file is left, and the same command run again adds the ANN structure."""
    flags = ["--index_type", "hnsw"]
    clean = SmallDisk(tmp_path / "clean")
    monkeypatch.setattr(builtins, "open", clean.open)
    assert main(["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(few_images), "--output_dir",
                 str(tmp_path / "clean"), "--disable_tqdm", "true", *flags]) == 0  # fmt: skip
    monkeypatch.undo()
    expected = EmbeddingIndex(str(tmp_path / "clean"))
    names = [name for name, _ in clean.writes]
    ann_write = next(i for i, name in enumerate(names) if name.startswith(".ann.faiss."))
    before = sum(size for _, size in clean.writes[:ann_write])
    ann_bytes = os.path.getsize(tmp_path / "clean" / "ann.faiss")

    out = tmp_path / "index"
    argv = ["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(few_images), "--output_dir",
            str(out), "--disable_tqdm", "true", *flags]  # fmt: skip
    monkeypatch.setattr(builtins, "open", SmallDisk(out, free=before + 64).open)
    capsys.readouterr()
    assert main(argv) == 2
    monkeypatch.undo()
    line = _error_line(capsys)
    assert line.startswith(f"vlfit retrieve: error: no space left on the device of {out} writing {out / 'ann.faiss'} (")
    assert ann_bytes / 2 <= _needed_bytes(line) <= 2 * ann_bytes
    assert "the index keeps every shard its manifest lists" in line
    assert line.endswith("free space there and run the same command again to build it")
    assert not _temporary_files(out) and not (out / "ann.faiss").exists()
    partial = EmbeddingIndex(str(out))
    assert partial.ids() == expected.ids() and partial.manifest.ann is None

    assert main(argv) == 0
    assert EmbeddingIndex(str(out)).manifest.ann is not None


def _prepare(data: str, out: Path) -> int:
    return main(["prepare", "--dataset_name", data, "--splits", "train", "--output_dir", str(out), "--model_preset",
                 "tiny", "--shard_size", "16", "--num_proc", "1", "--progress", "false"])  # fmt: skip


def test_prepare_on_a_full_disk_ends_in_one_line_naming_the_shards_kept_and_resumes(
    synthetic_dataset_dir, tmp_path, monkeypatch, capsys
):
    """The second parquet shard is written into /dev/full (a device that is always full; pyarrow's real ENOSPC):
    exit 2 and one line naming the shard, the folder's free space, about what the shards left need and that the
    folder keeps the shard its manifest lists; the same command run again completes the folder."""
    import pyarrow.parquet as pq

    from vlfit.data.prepare import MANIFEST_NAME

    write_table = pq.write_table

    def into_a_full_device(table, where, *args, **kwargs):
        if "train-00001-of-" not in os.path.basename(str(where)):
            return write_table(table, where, *args, **kwargs)
        # An open file, not the path: pyarrow removes a path it failed to write, and that must not be /dev/full.
        with open("/dev/full", "wb") as full:
            return write_table(table, full, *args, **kwargs)

    out = tmp_path / "prepared"
    monkeypatch.setattr(pq, "write_table", into_a_full_device)
    capsys.readouterr()
    assert _prepare(synthetic_dataset_dir, out) == 2
    monkeypatch.undo()
    line = _error_line(capsys)
    shards = sorted(name for name in os.listdir(out) if name.endswith(".parquet"))
    assert shards == ["train-00000-of-00004.parquet"]
    assert line.startswith(f"vlfit prepare: error: no space left on the device of {out} writing "
                           f"{out / 'train-00001-of-00004.parquet'} (")  # fmt: skip
    shard_bytes = os.path.getsize(out / shards[0])
    assert 2 * shard_bytes <= _needed_bytes(line) <= 4 * shard_bytes  # the three shards left, roughly
    assert line.endswith(f"free, about {format_bytes(_needed_bytes(line))} needed); the folder keeps the 1 of 4 "
                         f"shards its {MANIFEST_NAME} lists: free space there and run the same command again to "
                         "resume")  # fmt: skip
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # no partial shard left

    assert _prepare(synthetic_dataset_dir, out) == 0
    assert len([name for name in os.listdir(out) if name.endswith(".parquet")]) == 4
