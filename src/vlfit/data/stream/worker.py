"""One role's reader: its sources' shards interleaved by weight, through a shuffle buffer, resumable exactly.

Each pull draws a source by weight (among those with shards left) and takes that source's next sample; a source
keeps one shard open at a time. The shuffle buffer holds up to ``shuffle_buffer`` samples: once full, every item is
a uniform draw from it, and the freed slot takes the next pull (webdataset's buffer). ``shuffle_buffer`` 0 or 1
yields samples in pull order.

Resuming from a ``WorkerState`` reopens each source's shard at its cursor and skips the samples already read, and
re-reads the buffered samples from their shards (the buffer's oldest samples come from a few shards before the
current one), so the reader then yields what the uninterrupted one would have.

A shard whose server cannot be reached (``BadShard.unreachable``) ends the reader with ``SourceUnreachableError``
instead of being given up: its consumer saves the position of what it consumed, and a resume reads on from there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np

from vlfit.data.bad_samples import BadSampleInfo
from vlfit.data.records import Record
from vlfit.data.stream.order import BUFFER, MIX, Draws, ShardSequence, pick
from vlfit.data.stream.shards import BadShard, ShardReader, ShardSample, ShardUnreadableError, SourceUnreachableError
from vlfit.data.stream.state import StreamItem, WorkerPosition, WorkerState
from vlfit.data.stream.urls import StreamSource
from vlfit.errors import DataError

logger = logging.getLogger(__name__)

# With resampling a role draws shards forever; this many given up in a row, with no sample between, means the data
# cannot be read at all (rather than a few bad shards), and the stream stops instead of retrying for ever.
MAX_BAD_SHARDS_IN_A_ROW = 64


class RoleReader:
    """The items one role yields in one epoch (an iterator; iterate it once).

    Args:
        sources: The stream's sources.
        reader: How shards are read.
        seed: The stream's seed.
        epoch: The epoch (a key of every draw and of the shard order).
        role: This reader's role (``rank * num_workers + worker``).
        roles: How many roles there are (``world_size * num_workers``).
        shuffle_buffer: Samples the shuffle buffer holds (0: no shuffle).
        shuffle_shards: Shuffle each source's shard order per epoch (without resampling).
        resampled: Draw shards with replacement, forever.
        state: Where to resume; ``None``: at the epoch's start.
    """

    def __init__(
        self,
        sources: Sequence[StreamSource],
        reader: ShardReader,
        *,
        seed: int,
        epoch: int,
        role: int,
        roles: int,
        shuffle_buffer: int,
        shuffle_shards: bool,
        resampled: bool,
        state: WorkerState | None = None,
    ) -> None:
        self._reader = reader
        self._epoch, self._role, self._roles = epoch, role, roles
        self._resampled = resampled
        self._weights = [s.weight for s in sources]
        self._shards = [
            ShardSequence(
                s.urls,
                source=i,
                seed=seed,
                epoch=epoch,
                role=role,
                roles=roles,
                shuffle=shuffle_shards,
                resampled=resampled,
            )
            for i, s in enumerate(sources)
        ]
        self._mix, self._shuffle = Draws(seed, epoch, role, MIX), Draws(seed, epoch, role, BUFFER)
        self._capacity = max(1, shuffle_buffer)
        state = state or WorkerState()
        self._emitted, self._drawn = state.emitted, state.drawn
        cursors = state.cursors or tuple((0, 0) for _ in sources)
        self._shard_number = [k for k, _ in cursors]
        self._read = [i for _, i in cursors]
        self._open: list[Iterator[ShardSample] | None] = [None] * len(sources)
        self._active = [self._shards[s][k] is not None for s, k in enumerate(self._shard_number)]
        self._records: list[Record] = []
        self._coords = np.zeros((self._capacity, 3), dtype=np.int32)
        self._pending = state.buffer if len(state.buffer) else None
        self._bad_shards: list[BadShard] = []
        self._bad_samples: list[BadSampleInfo] = []
        self._bad_in_a_row = 0

    def __iter__(self) -> Iterator[StreamItem]:
        try:
            if self._pending is not None:
                self._refill(self._pending)
                self._pending = None
            while True:
                while len(self._records) < self._capacity and self._pull():
                    pass
                n = len(self._records)
                if n == 0:
                    break
                slot = min(int(self._shuffle[self._emitted] * n), n - 1) if self._capacity > 1 else 0
                self._emitted += 1
                record = self._take(slot)
                yield StreamItem(record, self._position())
            if self._bad_shards or self._bad_samples:  # nothing left to carry the last reports
                yield StreamItem(None, self._position())
        finally:
            for s in range(len(self._open)):
                self._close(s)

    # ------------------------------------------------------------------------------------------ the buffer

    def _take(self, slot: int) -> Record:
        last = len(self._records) - 1
        record = self._records[slot]
        self._records[slot] = self._records[last]
        self._coords[slot] = self._coords[last]
        self._records.pop()
        return record

    def _append(self, source: int, shard: int, index: int, record: Record) -> None:
        self._coords[len(self._records)] = (source, shard, index)
        self._records.append(record)

    def _position(self) -> WorkerPosition:
        state = WorkerState(
            self._emitted,
            self._drawn,
            tuple(zip(self._shard_number, self._read, strict=True)),
            self._coords[: len(self._records)].copy(),
        )
        position = WorkerPosition(
            self._epoch, self._role, self._roles, state, tuple(self._bad_shards), tuple(self._bad_samples)
        )
        self._bad_shards.clear()
        self._bad_samples.clear()
        return position

    # ------------------------------------------------------------------------------------------ the sources

    def _pull(self) -> bool:
        """Add the next sample to the buffer; ``False`` when every source has run out."""
        while any(self._active):
            source = pick(self._weights, self._active, self._mix[self._drawn])
            self._drawn += 1
            got = self._next_from(source)
            if got is not None:
                self._append(source, *got)
                return True
        return False

    def _next_from(self, source: int) -> tuple[int, int, Record] | None:
        """``(shard number, index, record)`` of the source's next sample; ``None`` (and inactive) when it ran out."""
        while True:
            samples = self._open[source]
            if samples is None:
                url = self._shards[source][self._shard_number[source]]
                if url is None:
                    self._active[source] = False
                    return None
                samples = self._open[source] = self._reader.samples(url, self._read[source])
            try:
                index, item = next(samples)
            except StopIteration:
                self._next_shard(source)
                continue
            except ShardUnreadableError as err:
                self._given_up(err)
                self._next_shard(source)
                continue
            self._read[source] = index + 1
            if isinstance(item, Record):
                self._bad_in_a_row = 0
                return self._shard_number[source], index, item
            self._bad_samples.append(item)

    def _given_up(self, error: ShardUnreadableError) -> None:
        bad = error.bad_shard or BadShard("?", str(error), 0)
        if bad.unreachable:
            # The server is down, not the shard bad: stop here, for the consumer to save its place, rather than give
            # up each shard after it too (and lose them). Resuming reads this shard again.
            raise SourceUnreachableError(f"cannot reach the server of {bad.url}: {bad.reason}", bad) from error
        self._bad_shards.append(bad)
        self._bad_in_a_row = self._bad_in_a_row + 1 if bad.samples_read == 0 else 0
        if self._resampled and self._bad_in_a_row >= MAX_BAD_SHARDS_IN_A_ROW:
            raise DataError(
                f"{self._bad_in_a_row} shards in a row could not be read (the last: {bad.url}: {bad.reason}); "
                "check the URLs and the network, or raise --shard_timeout"
            )

    def _next_shard(self, source: int) -> None:
        self._close(source)
        self._shard_number[source] += 1
        self._read[source] = 0
        self._active[source] = self._shards[source][self._shard_number[source]] is not None

    def _close(self, source: int) -> None:
        samples = self._open[source]
        self._open[source] = None
        if samples is not None:
            samples.close()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------ resuming

    def _refill(self, buffer: np.ndarray) -> None:
        """Read the buffered samples of a resumed state again, in buffer order; the shards of the sources' cursors
        are left open at them. Samples whose shard fails now are left out (and the shard reported)."""
        found: list[Record | None] = [None] * len(buffer)
        wanted: dict[tuple[int, int], dict[int, int]] = {}
        for position, (source, shard, index) in enumerate(buffer.tolist()):
            wanted.setdefault((source, shard), {})[index] = position
        for (source, shard), needed in sorted(wanted.items()):
            current = shard == self._shard_number[source]
            last = self._read[source] - 1 if current else max(needed)
            url = self._shards[source][shard]
            if url is None or not needed or last < max(needed):
                raise DataError(f"the resume state lists a buffered sample that this stream never read ({url})")
            samples = self._reader.samples(url, min(needed))
            finished = True
            try:
                for index, item in samples:
                    if index in needed and isinstance(item, Record):
                        found[needed[index]] = item
                    if index >= last:
                        finished = False
                        break
            except ShardUnreadableError as err:
                bad = err.bad_shard or BadShard(url, str(err), 0)
                if bad.unreachable:
                    raise SourceUnreachableError(f"cannot reach the server of {url}: {bad.reason}", bad) from err
                self._bad_shards.append(bad)
            if current and not finished:
                self._open[source] = samples  # already at the cursor
            else:
                samples.close()  # type: ignore[attr-defined]
                if current:  # the shard ended (or failed) before the cursor: the next pull moves on
                    self._next_shard(source)
        missing = [p for p, record in enumerate(found) if record is None]
        if missing:
            logger.warning("%d buffered samples of the resume state could not be read again", len(missing))
        for position, record in enumerate(found):
            if record is not None:
                source, shard, index = (int(v) for v in buffer[position])
                self._append(source, shard, index, record)
