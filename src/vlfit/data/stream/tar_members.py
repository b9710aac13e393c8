"""The members of a tar archive read front to back from a file object, for streamed shards.

``tarfile``'s stream mode (``r|``) parses every header field of every member in Python and reads the data 10 KB at
a time; a WebDataset shard needs only each member's name, size and type. ``TarMembers`` reads those from the
512-byte headers (ustar, GNU and POSIX pax archives: the ``prefix`` field, GNU long names and pax ``path`` and
``size`` records), checks each header's checksum, and reads a member's data in one call, or skips it. On local
shards of 40 KB samples that halves the CPU time of the whole stream reader per sample (about 0.25 to 0.12 ms).
A damaged header or an archive cut short raises ``tarfile.ReadError``, as ``tarfile`` does (a fault: the shard is
retried, then given up and counted). A file that is not a tar archive at all (its first header is not one: an HTML
page served in its place, an empty body) raises ``NotATarError``, which no retry changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from tarfile import ReadError
from typing import IO

BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")  # a file, an old-style file, a contiguous file
_SKIP_CHUNK = 1 << 20


class NotAShardError(ValueError):
    """What was read is not a shard at all (an HTML page, a JSON error, an empty body): no retry makes it one."""


class NotATarError(NotAShardError, ReadError):
    """The file's first 512 bytes are not a tar header."""


@dataclass(frozen=True, slots=True)
class TarMember:
    """One member: its name, data size, whether it is a regular file, and where its first header starts."""

    name: str
    size: int
    is_file: bool
    offset: int


def _number(field: bytes) -> int:
    """A numeric header field: octal digits (NUL or space terminated), or GNU's base-256 for large values."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * (len(field) - 1))) if field[0] & 0x40 else value
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ReadError(f"invalid number {digits!r} in a tar header") from None


def _padded(size: int) -> int:
    """The bytes a member of ``size`` data bytes takes: whole blocks."""
    return -(-size // BLOCK) * BLOCK


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, str]:
    """``key=value`` records of a pax extended header (``"<length> <key>=<value>\\n"`` each)."""
    records, at = {}, 0
    while at < len(data):
        space = data.find(b" ", at)
        if space < 0:
            break
        try:
            length = int(data[at:space])
        except ValueError:
            raise ReadError("invalid pax extended header") from None
        if length <= 0:
            raise ReadError("invalid pax extended header")
        key, _, value = data[space + 1 : at + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records


class TarMembers:
    """Iterate the members of the archive in ``file`` (read from where it stands, which is ``offset`` in the
    archive); after each member, ``read()`` returns its data, else the next step skips it.

    Args:
        file: A binary file object, read sequentially (it need not seek).
        offset: Where the file stands in the archive (a reader that seeked to a member's header): member offsets
            count from the archive's start.
    """

    def __init__(self, file: IO[bytes], offset: int = 0) -> None:
        self._file = file
        self._position = offset
        self._unread = 0  # data and padding of the current member not read yet
        self._size = 0  # data bytes of the current member
        self._ended = False

    def __iter__(self) -> Iterator[TarMember]:
        return self

    def __next__(self) -> TarMember:
        if self._ended:
            raise StopIteration
        self._skip(self._unread)
        self._unread = self._size = 0
        first = self._position
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            header = self._file.read(BLOCK)
            if len(header) < BLOCK:
                if self._position == 0:
                    raise NotATarError(f"not a tar archive: {_what(header)}")
                if not header:  # no end-of-archive blocks: what tarfile also takes for the end
                    self._ended = True
                    raise StopIteration
                raise ReadError("unexpected end of data in a tar header")
            self._position += BLOCK
            if header.count(0) == BLOCK:
                self._ended = True  # end-of-archive marker
                raise StopIteration
            if self._position == BLOCK and first == 0:
                try:
                    self._check(header)
                except ReadError:
                    what = _what(header)
                    raise NotATarError(f"not a tar archive (bad checksum in its first header): {what}") from None
            else:
                self._check(header)
            size, kind = _number(header[124:136]), header[156:157]
            padded = _padded(size)
            if kind in (b"L", b"x", b"g"):  # a GNU long name, a pax header (for the next member, or global)
                data = self._exactly(padded)[:size]
                if kind == b"L":
                    long_name = _text(data)
                elif kind == b"x":
                    pax.update(_pax_records(data))
                continue
            if kind == b"K":  # a GNU long link target: nothing a shard needs
                self._skip(padded)
                continue
            name = _text(header[0:100])
            if header[257:262] == b"ustar" and header[345] != 0:
                name = f"{_text(header[345:500])}/{name}"
            name = pax.get("path", long_name or name)
            if "size" in pax:
                size = int(pax["size"])
                padded = _padded(size)
            if kind == b"5" or (kind == b"\0" and name.endswith("/")):  # a folder (old tars: a file named "x/")
                kind, name = b"5", name.rstrip("/")
            self._size, self._unread = size, padded
            return TarMember(name, size, kind in _REGULAR, first)

    def read(self) -> bytes:
        """The data of the member just returned (once; then b"")."""
        if not self._unread:
            return b""
        data = self._exactly(self._size)
        self._skip(self._unread - self._size)  # the padding to the next block
        self._unread = 0
        return data

    def _exactly(self, n: int) -> bytes:
        data = self._file.read(n) if n else b""
        if len(data) < n:
            raise ReadError("unexpected end of data in a tar member")
        self._position += n
        return data

    def _skip(self, n: int) -> None:
        while n:
            chunk = self._file.read(min(n, _SKIP_CHUNK))
            if not chunk:
                raise ReadError("unexpected end of data in a tar member")
            n -= len(chunk)
            self._position += len(chunk)

    @staticmethod
    def _check(header: bytes) -> None:
        stored = _number(header[148:156])
        computed = sum(header) - sum(header[148:156]) + 8 * 32  # the checksum field counts as spaces
        if stored != computed:
            signed = sum(b - 256 if b > 127 else b for b in header[:148] + header[156:]) + 8 * 32
            if stored != signed:  # some old tars sum signed bytes
                raise ReadError("bad checksum in a tar header (the archive is damaged)")


def _what(start: bytes) -> str:
    """A few words on what a file that is not a tar archive starts with, for the message."""
    if not start:
        return "an empty body"
    text = start[:60].decode("utf-8", errors="replace").strip()
    kind = "an HTML page" if text.lower().startswith(("<!doctype html", "<html")) else "data"
    return f"{kind} starting {text[:40]!r}"
