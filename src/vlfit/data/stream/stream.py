"""``ShardStream``: an ``IterableDataset`` of records over the tar shards of weighted sources, resumable exactly.

How the resume state reaches the main process: every item a reader yields is a ``StreamItem(record, position)``,
and the position is that reader's whole state right after the item (``vlfit.data.stream.state``). DataLoader
workers send items to the main process anyway, so the position travels with its record; the consumer hands each
item's position to ``ShardStream.mark_consumed`` once the item is used (a training step), and ``state_dict`` is
then the latest position of every reader of this rank, plus which worker the DataLoader asks next. That works the
same with ``num_workers`` 0 (the main process is the only reader), 1 or more, and it counts what was consumed, not
what workers prefetched.

A resumed stream must run with the same sources, seed, shuffle settings, world size and ``num_workers``. The
DataLoader asks its workers for batches in turn, starting with worker 0; a state taken after a number of batches
that is not a multiple of ``num_workers`` records the worker due next, and the resumed workers take over each
other's roles so that worker 0 plays it: the resumed loader yields, in order, the batches the uninterrupted one
would have yielded next. Take the state between batches (every item of a consumed batch marked).

Call ``set_epoch`` before iterating each epoch (as with ``DistributedSampler``): the epoch keys the shard order and
every draw. With ``persistent_workers`` the workers keep the epoch they were started with, so recreate the loader
each epoch. Resampled streams are endless: bound the epoch by a number of steps.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils.data

from vlfit.data.stream.shards import BadShard, ShardReader
from vlfit.data.stream.state import STATE_FORMAT, StreamItem, WorkerPosition, WorkerState
from vlfit.data.stream.urls import StreamSource, is_http, protocol
from vlfit.data.stream.worker import RoleReader
from vlfit.errors import ConfigError
from vlfit.extras import require_extra

logger = logging.getLogger(__name__)


class ShardStream(torch.utils.data.IterableDataset):
    """Records from WebDataset tar shards at fsspec URLs, split over ranks and DataLoader workers, mixed by weight,
    shuffled, and resumable exactly. Items are ``StreamItem(record, position)`` (see the module's docstring).

    Without ``resampled``, an epoch reads every shard once: each source's shards are ordered per epoch and split
    over the ``world_size * num_workers`` readers without overlap (a source with fewer shards than readers leaves
    some readers without it), and samples are drawn from the sources in proportion to their weights while they last.
    With ``resampled`` (open_clip's ``--dataset-resampled``), each reader draws shards with replacement, forever.

    Args:
        sources: The sources (``parse_sources``); weights are relative.
        reader: How shards are read (layout, retries, timeout, fsspec options).
        shuffle_buffer: Samples each reader's shuffle buffer holds; 0: no shuffle.
        shuffle_shards: Shuffle each source's shard order per epoch (with ``seed``); without it, in spec order.
        seed: Seeds the shard order and every draw (the same on every rank).
        resampled: Draw shards with replacement, endlessly.
        rank: This process's rank.
        world_size: How many ranks read the stream.

    Raises:
        ConfigError: for a negative buffer, a rank outside the world, or a source without shards or weight.
        MissingExtraError: for HTTP(S) URLs without the ``stream`` extra.
    """

    def __init__(
        self,
        sources: Sequence[StreamSource],
        *,
        reader: ShardReader | None = None,
        shuffle_buffer: int = 0,
        shuffle_shards: bool = True,
        seed: int = 0,
        resampled: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        if not sources or any(not s.urls for s in sources):
            raise ConfigError("--train_file: every source of the stream needs at least one shard")
        if any(not s.weight > 0 for s in sources):
            raise ConfigError("--train_data_weights: every source's weight must be positive")
        if shuffle_buffer < 0:
            raise ConfigError(f"--shuffle_buffer must be 0 (no shuffle) or more samples, not {shuffle_buffer}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not one of the {world_size} processes of the run")
        require_extra("stream", "reading shards through fsspec", ("fsspec",))
        if any(is_http(url) for s in sources for url in s.urls):
            require_extra("stream", "reading shards over HTTP", ("aiohttp",))
        _check_protocols({protocol(url) for s in sources for url in s.urls})
        self.sources = tuple(sources)
        self.reader = reader or ShardReader()
        self.shuffle_buffer = shuffle_buffer
        self.shuffle_shards = shuffle_shards
        self.seed = seed
        self.resampled = resampled
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.bad_shards: list[BadShard] = []
        self.bad_sample_count = 0
        self._resume: dict[str, Any] | None = None  # a loaded state, for its epoch
        self._positions: dict[int, WorkerPosition] = {}  # the latest consumed position per role of this rank
        self._last_role: int | None = None

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` next (a loaded state stays in force for its own epoch only)."""
        if epoch != self.epoch:
            self._positions.clear()
            self._last_role = None
            if self._resume is not None and self._resume["epoch"] != epoch:
                self._resume = None
        self.epoch = epoch

    def __iter__(self) -> Iterator[StreamItem]:
        info = torch.utils.data.get_worker_info()
        num_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        resume = self._resume if self._resume is not None and self._resume["epoch"] == self.epoch else None
        first = 0
        if resume is not None:
            saved = resume["num_workers"]
            if saved is not None and saved != num_workers:
                raise ConfigError(
                    f"the stream's resume state was saved with {saved} DataLoader worker(s) per process; resume with "
                    f"--dataloader_num_workers {saved} (0 and 1 are the same) instead of {num_workers}"
                )
            first = resume["next_worker"]
        local = (worker + first) % num_workers
        role = self.rank * num_workers + local
        state = None
        if resume is not None and str(local) in resume["workers"]:
            state = WorkerState.from_dict(
                resume["workers"][str(local)], sources=len(self.sources), buffer_size=self.shuffle_buffer
            )
        return iter(
            RoleReader(
                self.sources,
                self.reader,
                seed=self.seed,
                epoch=self.epoch,
                role=role,
                roles=self.world_size * num_workers,
                shuffle_buffer=self.shuffle_buffer,
                shuffle_shards=self.shuffle_shards,
                resampled=self.resampled,
                state=state,
            )
        )

    def mark_consumed(self, position: WorkerPosition) -> None:
        """Note that the item carrying ``position`` was used: ``state_dict`` resumes after it. Also collects the
        bad shards and counts the bad samples it reports (``bad_shards``, ``bad_sample_count``)."""
        if position.epoch != self.epoch:
            self.set_epoch(position.epoch)
        self._positions[position.role] = position
        self._last_role = position.role
        self.bad_shards.extend(position.bad_shards)
        self.bad_sample_count += len(position.bad_samples)

    def state_dict(self) -> dict[str, Any]:
        """This rank's resume state: plain Python values (``torch.save`` or JSON), a few counters per worker plus
        12 bytes per buffered sample."""
        resume = self._resume if self._resume is not None and self._resume["epoch"] == self.epoch else None
        workers: dict[str, Any] = dict(resume["workers"]) if resume is not None else {}
        num_workers = resume["num_workers"] if resume is not None else None
        next_worker = resume["next_worker"] if resume is not None else 0
        for role, position in self._positions.items():
            num_workers = position.roles // self.world_size
            workers[str(role - self.rank * num_workers)] = position.state.to_dict()
        if self._last_role is not None and num_workers:
            next_worker = (self._last_role - self.rank * num_workers + 1) % num_workers
        return {
            "format": STATE_FORMAT,
            "settings": self._settings(),
            "epoch": self.epoch,
            "rank": self.rank,
            "num_workers": num_workers,
            "next_worker": next_worker,
            "workers": workers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``'s value: the next iteration (of the state's epoch) continues after the last
        item marked consumed.

        Raises:
            ConfigError: when the state is of another stream (sources, seed, shuffle settings, world size or rank).
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError("not a ShardStream resume state (or one of another format); save it with state_dict()")
        saved, mine = state["settings"], self._settings()
        for key in mine:
            if saved.get(key) != mine[key]:
                raise ConfigError(
                    f"the stream's resume state was saved with another {key} ({saved.get(key)!r}, now {mine[key]!r}); "
                    "resume with the same data and settings, or start the epoch afresh"
                )
        if state["rank"] != self.rank:
            raise ConfigError(f"the stream's resume state is rank {state['rank']}'s; this is rank {self.rank}")
        self._resume = {k: state[k] for k in ("epoch", "num_workers", "next_worker", "workers")}
        self.epoch = int(state["epoch"])
        self._positions.clear()
        self._last_role = None

    def _settings(self) -> dict[str, Any]:
        """What a state depends on, compared on load (the shard lists by digest)."""
        return {
            "sources": [
                {
                    "shards": len(s.urls),
                    "weight": s.weight,
                    "digest": hashlib.sha1("\n".join(s.urls).encode()).hexdigest(),
                }
                for s in self.sources
            ],
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle_shards": self.shuffle_shards,
            "resampled": self.resampled,
            "world_size": self.world_size,
        }


def _check_protocols(protocols: set[str]) -> None:
    """Refuse now a URL protocol fsspec does not know or cannot load, rather than as a run of bad shards."""
    import fsspec

    for name in sorted(protocols):
        try:
            fsspec.get_filesystem_class(name)
        except ValueError:
            raise ConfigError(f"--train_file: fsspec knows no protocol {name!r} (in {name}://...)") from None
        except ImportError as err:
            raise ConfigError(f"--train_file: {name}:// URLs need a package fsspec could not import: {err}") from None
