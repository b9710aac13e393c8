"""The position of a stream reader, carried by every item it yields, and the resume state made of positions.

A reader's position after an item is small: two draw counters, per source the shard it is in and how many of its
samples it read, and the coordinates ``(source, shard number, sample index)`` of each sample in its shuffle buffer
(12 bytes a buffered sample). Every random choice is a draw by index (``vlfit.data.stream.order``), so these
counters are the whole random state; the buffered samples are read again from their shards on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from vlfit.data.bad_samples import BadSampleInfo
from vlfit.data.records import Record
from vlfit.data.stream.shards import BadShard
from vlfit.errors import ConfigError

STATE_FORMAT = 1


def _no_buffer() -> np.ndarray:
    return np.zeros((0, 3), dtype=np.int32)


@dataclass(frozen=True, eq=False)
class WorkerState:
    """Where one reader (one role) is in its epoch: enough to continue exactly from there.

    Attributes:
        emitted: Items yielded (draws of the shuffle buffer made).
        drawn: Source draws made.
        cursors: Per source, ``(shard number, samples of it read)``; empty: the epoch's start.
        buffer: ``(n, 3)`` int32, ``(source, shard number, sample index)`` of each buffered sample, in buffer order.
    """

    emitted: int = 0
    drawn: int = 0
    cursors: tuple[tuple[int, int], ...] = ()
    buffer: np.ndarray = field(default_factory=_no_buffer)

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (for ``torch.save`` or JSON)."""
        return {
            "emitted": self.emitted,
            "drawn": self.drawn,
            "cursors": [list(c) for c in self.cursors],
            "buffer": self.buffer.tolist(),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any], *, sources: int, buffer_size: int) -> WorkerState:
        """The inverse of ``to_dict``, checked against the stream it is loaded into.

        Raises:
            ConfigError: when the state does not fit a stream of ``sources`` sources and this shuffle buffer.
        """
        try:
            cursors = tuple((int(k), int(i)) for k, i in state["cursors"])
            buffer = np.asarray(state["buffer"], dtype=np.int32).reshape(-1, 3)
            emitted, drawn = int(state["emitted"]), int(state["drawn"])
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                f"the stream's resume state is malformed ({err!r}); was it saved by ShardStream?"
            ) from err
        if cursors and len(cursors) != sources:
            raise ConfigError(f"the resume state is of a stream of {len(cursors)} sources, not {sources}")
        sources_ok = not len(buffer) or (buffer[:, 0].min() >= 0 and buffer[:, 0].max() < sources)
        if len(buffer) > max(buffer_size, 1) or not sources_ok:
            raise ConfigError(f"the resume state's shuffle buffer does not fit --shuffle_buffer {buffer_size}")
        return cls(emitted, drawn, cursors, buffer)


@dataclass(frozen=True, eq=False)
class WorkerPosition:
    """What an item tells the main process about the reader that yielded it.

    Attributes:
        epoch: The epoch being read.
        role: The reader: ``rank * num_workers + worker``.
        roles: ``world_size * num_workers``.
        state: The reader's state right after yielding this item.
        bad_shards: Shards the reader gave up since its previous item.
        bad_samples: ``(key, reason)`` of samples without a record (no image member, invalid json) since then.
    """

    epoch: int
    role: int
    roles: int
    state: WorkerState
    bad_shards: tuple[BadShard, ...] = ()
    bad_samples: tuple[BadSampleInfo, ...] = ()


class StreamItem(NamedTuple):
    """One item of the stream: a record and the position of its reader.

    ``record`` is ``None`` only for the last item of a reader whose last shards were bad and left no record to carry
    the report: leave it out of the batch, but hand its position to ``ShardStream.mark_consumed`` like the others.
    """

    record: Record | None
    position: WorkerPosition
