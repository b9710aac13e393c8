"""One shard read as a stream from an fsspec URL: its samples as records, through network faults. A shard is a
WebDataset tar file, or a parquet file (``vlfit.data.stream.parquet_rows``: a hub dataset's files).

The shard is read front to back (``TarMembers``) as fsspec fetches it, so a sample is ready as soon as its
bytes arrive and nothing is downloaded ahead of the reader beyond fsspec's read-ahead block. A sample is a run of
consecutive members with the same key (WebDataset writes them so); ``WebDatasetLayout`` makes its record by the
rules ``TarSource`` reads shards with.

A transient fault (HTTP 5xx, a refused or reset connection, a read that stalls past ``timeout``, a truncated
archive) is retried ``retries`` times with exponential backoff. A permanent one is not: an HTTP status that no retry
changes (404, 403, 410...), a body that is not a tar or parquet file (an HTML error page), a missing local file; the
shard is given up at once. A shard given up because its host cannot be reached at all (connection refused, no such
host, the connection reset before an answer) is marked ``unreachable``: the server is down, rather than the shard
bad. A stream stops at such a shard (``SourceUnreachableError``) instead of giving up the shards after it.

A server that ignores ``Range`` requests (it answers 200 with the whole file, as ``python -m http.server`` and many
static hosts do) cannot serve fsspec's block reads past the first block. The first time that is seen for a host,
the host is remembered (per process) and its shards are read from then on as whole-file streams (fsspec's
``block_size=0``): one GET per shard, read front to back; the shard being read continues from its start, the
samples already yielded skipped, without counting a retry. ``storage_options={"block_size": 0}`` (or
``--shard_block_size 0``) asks for that from the start.

A column named on purpose (``--image_column``, ``--caption_column``) that the first sample read of a shard does
not have is a ``DataError`` (``WebDatasetLayout.check_columns``, as ``TarSource`` checks it), not retried.

A retry resumes at the first sample not yet yielded: it seeks to that sample's first tar header when the file can
seek (fsspec's HTTP files do, with Range requests), otherwise it reads from the start again and skips what was
already yielded. The count of retries starts again after any progress. When the retries are spent the shard is
given up with ``ShardUnreadableError`` carrying a ``BadShard``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import tarfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import urlsplit

from vlfit.data.bad_samples import BadSampleInfo, describe_error
from vlfit.data.records import BadRecordError, Record
from vlfit.data.stream.parquet_rows import is_parquet, parquet_rows
from vlfit.data.stream.tar_members import NotAShardError, TarMembers
from vlfit.data.stream.urls import is_http, protocol
from vlfit.data.webdataset import WebDatasetLayout, split_member_name
from vlfit.errors import ConfigError, DataError, UserError, error_chain, first_line

logger = logging.getLogger(__name__)

READ_BUFFER_BYTES = 1 << 20  # what a remote shard is read in at a time from fsspec's block cache (at most a block)

ShardSample = tuple[int, "Record | BadSampleInfo"]
"""``(index of the sample in its shard, its record)``, or ``(index, (key, reason))`` for a sample that has no
record (no image member, an invalid ``.json``)."""


@dataclass(frozen=True)
class BadShard:
    """A shard given up after its retries: the samples of it not read count as bad.

    Attributes:
        url: The shard.
        reason: The last error, with its causes (``FileNotFoundError: ... (ClientResponseError: 500, ...)``).
        samples_read: How many of its samples were read (and yielded) before it was given up.
        unreachable: Its host could not be reached (connection refused, no such host): the source is down, not
            the shard bad.
    """

    url: str
    reason: str
    samples_read: int
    unreachable: bool = False


class ShardUnreadableError(DataError):
    """A shard could not be read after its retries (``bad_shard`` says which, why and how far it got).

    The constructor takes the message alone so that the type survives torch's re-raise of a worker's exception.
    """

    def __init__(self, message: str, bad_shard: BadShard | None = None) -> None:
        super().__init__(message)
        self.bad_shard = bad_shard


class SourceUnreachableError(ShardUnreadableError):
    """The server of a stream's shard could not be reached after the shard's retries (``BadShard.unreachable``):
    the stream stops there, rather than giving up every shard after it one by one, so that its consumer can save
    its place and resume once the server is back.

    Re-raised by torch from a DataLoader worker, the message is the worker's traceback: the original message (its
    last line) is kept instead.
    """

    def __init__(self, message: str, bad_shard: BadShard | None = None) -> None:
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        if len(lines) > 2 and lines[0].startswith("Caught ") and lines[1].startswith("Original Traceback"):
            message = re.sub(rf"^(?:[\w.]+\.)?{type(self).__name__}: ", "", lines[-1])
        super().__init__(message, bad_shard)


def _faults() -> tuple[type[BaseException], ...]:
    """The errors that mean the shard (or the way to it) failed, not the caller: these are retried (a ``UserError``,
    which names wrong data or settings, never is)."""
    errors: list[type[BaseException]] = [OSError, EOFError, TimeoutError, asyncio.TimeoutError, tarfile.TarError]
    # fsspec's HTTP files raise ValueError when a server stops honouring Range requests midway.
    errors.append(ValueError)
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)
    except ImportError:  # pragma: no cover - only HTTP needs aiohttp, and the stream checks for it up front
        pass
    return tuple(errors)


# HTTP statuses no retry changes: the shard is not there, or not for us. 408 (timeout), 425 and 429 (too many
# requests) are a server's "later", retried like 5xx.
_TRANSIENT_CLIENT_STATUSES = frozenset({408, 425, 429})
# Hosts (netlocs) seen to ignore Range requests, read as whole-file streams from then on (per process).
_WHOLE_FILE_HOSTS: set[str] = set()


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and each error that caused it (fsspec hides HTTP statuses and connection errors as causes), up to
    a ``raise ... from None``."""
    return error_chain(error, follow_suppressed=False)


def http_status(error: BaseException) -> int | None:
    """The HTTP status of the response behind ``error`` (``None`` when no response came)."""
    try:
        from aiohttp import ClientResponseError
    except ImportError:  # pragma: no cover - no HTTP without aiohttp
        return None
    return next((err.status for err in _chain(error) if isinstance(err, ClientResponseError)), None)


def is_permanent(url: str, error: BaseException) -> bool:
    """Whether no retry can read ``url`` after ``error``: a 4xx status other than 408/425/429, a body that is not
    a tar or parquet file, a local file that is not there."""
    status = http_status(error)
    if status is not None:
        return 400 <= status < 500 and status not in _TRANSIENT_CLIENT_STATUSES
    if any(isinstance(err, NotAShardError) for err in _chain(error)):
        return True
    return protocol(url) in ("file", "local") and isinstance(error, FileNotFoundError)


def is_unreachable(error: BaseException) -> bool:
    """Whether ``error`` means the host could not be reached at all (refused, no such host, the connection reset or
    closed before an answer): no response came."""
    if http_status(error) is not None:
        return False
    kinds: tuple[type[BaseException], ...] = (ConnectionRefusedError, ConnectionResetError)
    try:
        from aiohttp import ClientConnectorError, ServerDisconnectedError

        kinds += (ClientConnectorError, ServerDisconnectedError)
    except ImportError:  # pragma: no cover - no HTTP without aiohttp
        pass
    return any(isinstance(err, kinds) for err in _chain(error))


def _ignores_range(error: BaseException) -> bool:
    """Whether ``error`` is fsspec's refusal of a server that answered a Range request with the whole file."""
    return any(isinstance(err, ValueError) and "support range requests" in str(err) for err in _chain(error))


def _host(url: str) -> str:
    return urlsplit(url).netloc.lower()


def describe_fault(error: BaseException) -> str:
    """``Type: first line`` of ``error`` and of each error that caused it (fsspec hides HTTP statuses as causes)."""
    parts = []
    for current in _chain(error):
        name, text = type(current).__name__, first_line(current, 300)
        parts.append(name if text == name else f"{name}: {text}")
    return parts[0] + "".join(f" ({part})" for part in parts[1:])


@dataclass(frozen=True)
class ShardReader:
    """How to read shards: the sample layout, the retries and the per-read timeout. Picklable (sent to workers).

    Args:
        layout: Which members make a sample's image, caption and extra columns.
        retries: How many times a failing shard is tried again before it is given up (``--shard_retries``).
        timeout: Seconds one connection, or one read on it, may take before it counts as a fault
            (``--shard_timeout``); given to aiohttp for HTTP(S) URLs.
        backoff: Seconds before the first retry; each further retry waits twice as long.
        storage_options: Passed to fsspec's filesystem (credentials, ``headers``, ``block_size``,
            ``client_kwargs``...: ``--storage_options``).
        block_size: Bytes fsspec fetches per request of a remote file (``--shard_block_size``); 0: each shard is
            one whole-file stream (servers that ignore Range requests); ``None``: fsspec's default, with servers
            that ignore Range detected and read as streams.
    """

    layout: WebDatasetLayout = field(default_factory=WebDatasetLayout)
    retries: int = 3
    timeout: float = 60.0
    backoff: float = 1.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ConfigError(f"--shard_retries must be 0 or more, not {self.retries}")
        if not self.timeout > 0:
            raise ConfigError(f"--shard_timeout must be a positive number of seconds, not {self.timeout}")
        if self.backoff < 0:
            raise ConfigError(f"the retry backoff must be 0 or more seconds, not {self.backoff}")
        if self.block_size is not None and self.block_size < 0:
            raise ConfigError(f"--shard_block_size must be 0 (whole-file streams) or more bytes, not {self.block_size}")

    def open(self, url: str) -> IO[bytes]:
        """Open ``url`` for reading through fsspec, with ``timeout`` on every connection and read for HTTP(S)."""
        import fsspec

        options = dict(self.storage_options)
        if is_http(url):
            import aiohttp

            client = dict(options.get("client_kwargs") or {})
            t = self.timeout
            client.setdefault("timeout", aiohttp.ClientTimeout(total=None, connect=t, sock_connect=t, sock_read=t))
            options["client_kwargs"] = client
        fs, path = fsspec.core.url_to_fs(url, **options)
        if protocol(url) in ("file", "local"):
            return fs.open(path, "rb")
        # A remote file (HTTP, S3, GCS, hf://...) is read front to back: fsspec's "readahead" cache replaces its
        # block on each fetch, where the default "bytes" cache grows and trims it (copying ~10 MB per 5 MB block).
        # Each read through fsspec's Python-level cache costs ~35 us, and the tar reader makes two or more per
        # member (its 512-byte headers): a C buffer in between takes them in 1 MB calls.
        block: dict[str, Any] = {} if self.block_size is None else {"block_size": self.block_size}
        if is_http(url) and _host(url) in _WHOLE_FILE_HOSTS:
            block = {"block_size": 0}
        file = fs.open(path, "rb", cache_type="readahead", **block)
        if isinstance(file, fsspec.spec.AbstractBufferedFile):
            buffer = min(READ_BUFFER_BYTES, file.blocksize) if file.blocksize else READ_BUFFER_BYTES
            return io.BufferedReader(file, buffer_size=buffer)  # no read bigger than the requests asked for
        return file

    def samples(self, url: str, start: int = 0) -> Iterator[ShardSample]:
        """The samples of one shard from sample ``start`` on, retrying faults (see the module's docstring).

        Args:
            url: The shard's URL or local path.
            start: How many samples to skip (a resumed stream's position in the shard).

        Yields:
            ``(index, record)``, or ``(index, (key, reason))`` for a sample without a record.

        Raises:
            ShardUnreadableError: once the retries are spent (after the samples that could be read).
        """
        faults = _faults()
        reached = start  # the next sample to yield
        known = (0, 0)  # (index, byte offset) of a sample's first header at or before `reached`
        failures = 0
        while True:
            attempt = self._attempt(url, known, reached)
            try:
                while True:
                    try:
                        index, item, next_known = next(attempt)
                    except StopIteration:
                        return
                    except UserError:  # the data or the settings are wrong: no retry reads it differently
                        raise
                    except faults as err:
                        if not self._whole_file_from_now(url, err):
                            failures += 1
                            self.retry_or_give_up(url, err, failures, reached)
                        break
                    if next_known is not None:
                        known = next_known
                    if item is None:  # before `start`, or yielded before a retry
                        continue
                    reached, failures = index + 1, 0
                    yield index, item
            finally:
                attempt.close()  # a consumer that stops early leaves no connection open

    def _attempt(
        self, url: str, known: tuple[int, int], wanted: int
    ) -> Iterator[tuple[int, Record | BadSampleInfo | None, tuple[int, int] | None]]:
        """One attempt at the shard from sample ``wanted`` on: ``(index, record or None before wanted, where the
        next sample starts when known)``. A parquet file reads from the row group holding ``wanted``."""
        if is_parquet(url):
            with self.open(url) as file:
                for index, item in parquet_rows(file, url, self.layout, wanted):
                    yield index, item, None
            return
        groups = self._groups(url, known, wanted)
        checked = False
        try:
            for index, key, members, next_offset in groups:
                if members is not None and not checked:  # the columns named on purpose, as TarSource checks them
                    self._check_columns(url, key, members)
                    checked = True
                item = None if members is None else self._assemble(url, key, members)
                yield index, item, None if next_offset is None else (index + 1, next_offset)
        finally:
            groups.close()

    def copy_to(self, url: str, path: str, chunk_size: int = 1 << 20) -> int:
        """Copy the shard at ``url`` byte for byte to the local file ``path``, retrying faults as ``samples`` does:
        a retry continues at the first byte not yet written when the file can seek, else starts over. The file
        appears only once complete (written beside it, then renamed).

        Returns:
            The bytes copied.

        Raises:
            ShardUnreadableError: once the retries are spent (nothing is left at ``path``).
        """
        faults = _faults()
        partial = f"{path}.part"
        written, failures = 0, 0
        try:
            with open(partial, "wb") as out:
                while True:
                    try:
                        with self.open(url) as file:
                            if written:
                                try:
                                    file.seek(written)
                                except (OSError, ValueError):  # a streaming file: from the start again
                                    out.seek(0)
                                    out.truncate()
                                    written = 0
                            while chunk := file.read(chunk_size):
                                out.write(chunk)
                                written += len(chunk)
                                failures = 0
                        break
                    except UserError:
                        raise
                    except faults as err:
                        if not self._whole_file_from_now(url, err):
                            failures += 1
                            self.retry_or_give_up(url, err, failures, 0)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return written

    def _whole_file_from_now(self, url: str, error: BaseException) -> bool:
        """Whether ``error`` was a server ignoring Range requests on a host not yet known to: the host is then read
        as whole-file streams, and the shard is tried again at once (not a retry)."""
        if not (is_http(url) and _ignores_range(error)) or _host(url) in _WHOLE_FILE_HOSTS:
            return False
        _WHOLE_FILE_HOSTS.add(_host(url))
        logger.warning(
            "%s ignores Range requests (it answered with the whole file): its shards are read as whole-file streams "
            "from now on (set --shard_block_size 0 to start so)",
            _host(url),
        )
        return True

    def retry_or_give_up(self, url: str, error: BaseException, failures: int, reached: int) -> None:
        """Wait before retry number ``failures``, or raise ``ShardUnreadableError`` when the retries are spent or
        the error is permanent (``is_permanent``: no retry)."""
        reason = describe_fault(error)
        permanent = is_permanent(url, error)
        if failures > self.retries or permanent:
            how = "without retrying (a permanent error)" if permanent else f"after {self.retries} retries"
            logger.warning("gave up shard %s %s (%d read): %s", url, how, reached, reason)
            bad = BadShard(url, reason, reached, unreachable=not permanent and is_unreachable(error))
            raise ShardUnreadableError(f"shard {url} could not be read: {reason}", bad) from error
        wait = self.backoff * 2 ** (failures - 1)
        logger.debug("shard %s: %s; retry %d of %d in %.1f s", url, reason, failures, self.retries, wait)
        time.sleep(wait)

    def _groups(
        self, url: str, known: tuple[int, int], wanted: int
    ) -> Iterator[tuple[int, str, dict[str, bytes] | None, int | None]]:
        """One attempt at the shard: ``(index, key, members, offset of the next sample's header)`` per sample, the
        members' bytes read only from sample ``wanted`` on (``None`` before it); from ``known`` when it can seek."""
        with self.open(url) as file:
            index, base = 0, 0
            if known[1]:
                try:
                    file.seek(known[1])
                    index, base = known
                except (OSError, ValueError):  # a streaming file: read from the start and skip
                    pass
            key: str | None = None
            members: dict[str, bytes] = {}
            archive = TarMembers(file, base)
            for member in archive:
                parts = split_member_name(member.name) if member.is_file else None
                if parts is None:
                    continue
                name, ext = parts
                if name != key:
                    if key is not None:
                        yield index, key, members if index >= wanted else None, member.offset
                        index += 1
                    key, members = name, {}
                if index >= wanted:
                    members[ext] = archive.read()
            if key is not None:
                yield index, key, members if index >= wanted else None, None

    def _check_columns(self, url: str, key: str, members: dict[str, bytes]) -> None:
        try:
            meta = self.layout.parse_json(key, members.get("json"))
        except BadRecordError:  # the sample is bad (reported as such); its keys cannot name a column
            meta = {}
        self.layout.check_columns(url, key, members, meta)

    def _assemble(self, url: str, key: str, members: dict[str, bytes]) -> Record | BadSampleInfo:
        layout = self.layout
        parts = layout.members(members)
        if parts.image is None:
            return key, layout.missing_image(key, url, members)
        try:
            meta = layout.parse_json(key, members.get("json"))
        except BadRecordError as err:
            sample_id, reason = describe_error(err, key)
            return sample_id, f"{reason} (shard {url})"
        text = members.get(parts.text) if parts.text else None
        extras = [members.get(e) if e else None for e in parts.extras]
        return layout.record(key, members[parts.image], text, meta, extras)
