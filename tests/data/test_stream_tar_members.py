"""``TarMembers`` reads what ``tarfile`` reads, from ustar, GNU and pax archives, and refuses damaged ones."""

from __future__ import annotations

import io
import tarfile

import pytest

from vlfit.data.stream.tar_members import TarMembers

LONG = "deep/" * 30 + "sample-0001.jpg"  # over 100 characters: a ustar prefix, a GNU long name or a pax path


def _archive(fmt: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        folder = tarfile.TarInfo("a")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        names = ["a/0001.jpg", "a/0001.txt", "ünïcode-0002.json", "empty.txt", LONG]
        if fmt != tarfile.USTAR_FORMAT:
            names.append("x" * 120 + ".txt")  # a name with no '/' to split at: GNU or pax only
        for i, name in enumerate(names):
            data = bytes(range(256)) * (i * 3) + name.encode()[: i * 7]
            info = tarfile.TarInfo(name)
            info.size = len(data) if name != "empty.txt" else 0
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("a/link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "a/0001.jpg" if fmt == tarfile.USTAR_FORMAT else "l" * 150
        archive.addfile(link)
    return buffer.getvalue()


def _with_tarfile(data: bytes) -> list[tuple[str, bool, int, bytes | None]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as archive:
        out = []
        for m in archive:
            content = archive.extractfile(m).read() if m.isfile() else None
            out.append((m.name, m.isfile(), m.offset, content))
        return out


@pytest.mark.parametrize(
    "fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["ustar", "gnu", "pax"]
)
def test_members_names_offsets_and_data_are_tarfiles(fmt: int) -> None:
    data = _archive(fmt)
    members = TarMembers(io.BytesIO(data))
    ours = [(m.name, m.is_file, m.offset, members.read() if m.is_file else None) for m in members]

    assert ours == _with_tarfile(data)
    assert LONG in [name for name, *_ in ours]


def test_a_reader_started_at_a_members_offset_reads_on_from_there_and_skips_unread_data() -> None:
    data = _archive(tarfile.PAX_FORMAT)
    expected = _with_tarfile(data)
    third = expected[3][2]
    file = io.BytesIO(data)
    file.seek(third)
    members = TarMembers(file, third)
    names = [(m.name, m.offset) for m in members]  # nothing read: every member's data is skipped

    assert names == [(name, offset) for name, _, offset, _ in expected[3:]]


def test_a_damaged_header_or_a_cut_archive_is_a_read_error() -> None:
    data = bytearray(_archive(tarfile.GNU_FORMAT))
    second = _with_tarfile(bytes(data))[1][2]
    damaged = data.copy()
    damaged[second + 10] ^= 0xFF  # a byte of the second member's name
    with pytest.raises(tarfile.ReadError, match="checksum"):
        list(TarMembers(io.BytesIO(bytes(damaged))))

    cut = TarMembers(io.BytesIO(bytes(data[: second + BLOCK_AND_A_BIT])))
    first = next(cut)
    assert first.name == "a"
    with pytest.raises(tarfile.ReadError, match="end of data"):
        for _ in cut:
            cut.read()

    with pytest.raises(tarfile.ReadError, match="empty"):  # a 0-byte shard is a fault, not a shard of 0 samples
        list(TarMembers(io.BytesIO(b"")))
    with pytest.raises(tarfile.ReadError, match="checksum"):  # an error page served as a shard
        list(TarMembers(io.BytesIO(b"<html>not found</html>".ljust(512))))


BLOCK_AND_A_BIT = 512 + 100  # into the second member's data
