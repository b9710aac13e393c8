"""Training on a ``ShardStream``: its epochs, its place in checkpoints, and equal steps on every process.

- ``StreamEpochs`` is the training loader of a streamed split. The Trainer starts a new pass over its loader each
  epoch; for a stream (which has no length) an epoch ends when the stream runs out, and every pass after the first
  is the stream's next epoch. The first pass reads the stream's current epoch: 0, or the one a checkpoint resumes
  (and goes on to the next when the checkpoint was taken at the epoch's very end).
- A checkpoint holds each process's stream state (``stream_state.json``, ``stream_state_N.json`` for process N):
  where every loader worker of the process stands (``ShardStream.state_dict``). A resumed run loads it instead of
  skipping batches, so it reads on from there, exactly.
- The epoch a run logs is the stream's epoch plus the share of ``max_steps`` read in it, counted in batches
  (``StreamEpochs.batches``, saved with the stream state), as the Trainer counts it for a loader without length:
  a resumed run logs the values the uninterrupted one did, not a count restarted at the resume.
- With several processes, the shards of an epoch rarely give every process the same number of batches. A process
  that ran out would stop taking part in DDP's gradient all-reduce while the others wait in it. ``agreed_batches``
  has the processes agree, step by step, on the fewest batches any of them has: the epoch ends for all at once,
  and what the others still held is read in no step (as ``--dataloader_drop_last`` leaves the tail of an epoch).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from vlfit.data.stream import ShardStream
from vlfit.errors import ConfigError
from vlfit.training.bad_sample_ledger import process_file_name

logger = logging.getLogger(__name__)

STREAM_STATE_FILE = "stream_state.json"


class StreamEpochs:
    """The loader of a streamed training split; each pass over it after the first reads the stream's next epoch."""

    def __init__(self, loader: DataLoader, stream: ShardStream, batches: int = 0) -> None:
        self.loader = loader
        self.stream = stream
        self.batches = batches  # batches consumed in the stream's current epoch (the trainer counts them)
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        if self._passes:
            self._next_epoch()
        self._passes += 1
        return self._read(first=self._passes == 1)

    def _read(self, first: bool) -> Iterator[Any]:
        read = False
        for batch in self._epoch():
            read = True
            yield batch
        if first and not read:  # resumed at the very end of an epoch: the Trainer would take it for an empty stream
            self._next_epoch()
            yield from self._epoch()

    def _epoch(self) -> Iterator[Any]:
        # The loader's own generator, seeded per epoch, seeds its workers: starting them draws nothing from the
        # global RNG, whose state a resumed run restores before the loader starts (dropout would differ otherwise).
        generator = self.loader.generator
        assert generator is not None, "StreamEpochs needs a loader made with its own generator"
        generator.manual_seed(self.stream.seed * 1_000_003 + self.stream.epoch)
        return iter(self.loader)

    def _next_epoch(self) -> None:
        self.batches = 0
        self.stream.set_epoch(self.stream.epoch + 1)
        logger.info("the training stream was read through: epoch %d of the stream begins", self.stream.epoch)


def agreed_batches(count: int, device: torch.device) -> int:
    """The fewest batches any process has for this step (``count`` itself with one process); a collective. A process
    whose stream lost its source passes -1: every process then gets -1 and stops at the same step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    # gloo reduces CPU tensors, nccl CUDA ones: the run's device fits its backend.
    fewest = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    return int(fewest.item())


def save_stream_state(stream: ShardStream, folder: str, process_index: int, batches: int = 0) -> None:
    """Write this process's stream state into a checkpoint folder, with the batches consumed in its epoch."""
    path = os.path.join(folder, process_file_name(STREAM_STATE_FILE, process_index))
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**stream.state_dict(), "batches_in_epoch": batches}, f)


def load_stream_state(stream: ShardStream, folder: str, process_index: int) -> int:
    """Resume ``stream`` from the state a checkpoint holds for this process; returns the batches consumed in its
    epoch (0 for a state saved without the count).

    Raises:
        ConfigError: when the checkpoint holds none (it was saved by a run that did not stream, or by fewer
            processes), or a state of another stream (``ShardStream.load_state_dict`` names what differs).
    """
    path = os.path.join(folder, process_file_name(STREAM_STATE_FILE, process_index))
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"checkpoint {folder} holds no stream position for process {process_index} ({os.path.basename(path)}): "
            "it was saved by a run that read its training data map-style, or by fewer processes; resume it the way "
            "it was trained, or start afresh in a new --output_dir"
        ) from None
    stream.load_state_dict(state)
    logger.info("resuming the training stream at epoch %d from %s", stream.epoch, path)
    return int(state.get("batches_in_epoch", 0))
