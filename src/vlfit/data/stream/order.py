"""What one reader of the stream reads, and in which order: a pure function of the seed, the epoch and its role.

A *role* is one DataLoader worker of one rank: role ``rank * num_workers + worker``, of ``world_size * num_workers``
roles. Every random choice is a draw by index from a counter-based stream keyed by ``(seed, epoch, role, purpose)``:
the ``n``-th draw is the same whoever computes it and whenever, so the state of a reader is a few counters, not a
generator's internals.

- Without resampling, each source's shards are put in an order per epoch (shuffled by ``(seed, epoch)`` unless
  shard shuffling is off; the same order on every rank) and role ``r`` takes every ``roles``-th one from ``r``: no
  shard is read twice in an epoch and none is left out.
- With resampling, role ``r``'s ``k``-th shard of a source is a draw with replacement among all its shards, forever.
- Each sample is taken from a source drawn by weight among the sources that still have shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Purposes of the draw streams (part of their key).
MIX, BUFFER, RESAMPLE, SHARD_ORDER = 0, 1, 2, 3
_UINT64 = 1 << 64


class Draws:
    """Uniform draws in ``[0, 1)`` by index, from a stream keyed by non-negative integers (computed in blocks)."""

    BLOCK = 1024

    def __init__(self, *key: int) -> None:
        self._key = [k % _UINT64 for k in key]  # numpy seeds must be non-negative
        self._block = -1
        self._values = np.empty(0)

    def __getitem__(self, index: int) -> float:
        block, offset = divmod(index, self.BLOCK)
        if block != self._block:
            self._values = np.random.default_rng([*self._key, block]).random(self.BLOCK)
            self._block = block
        return float(self._values[offset])


def epoch_shards(urls: Sequence[str], *, seed: int, epoch: int, source: int, shuffle: bool) -> list[str]:
    """A source's shards in the order of ``epoch`` (the same on every rank and worker)."""
    if not shuffle:
        return list(urls)
    order = np.random.default_rng([seed % _UINT64, epoch % _UINT64, SHARD_ORDER, source]).permutation(len(urls))
    return [urls[i] for i in order]


def role_shards(
    urls: Sequence[str], *, seed: int, epoch: int, source: int, shuffle: bool, role: int, roles: int
) -> list[str]:
    """The shards role ``role`` of ``roles`` reads in an epoch: every ``roles``-th of ``epoch_shards`` from ``role``."""
    return epoch_shards(urls, seed=seed, epoch=epoch, source=source, shuffle=shuffle)[role::roles]


class ShardSequence:
    """The ``k``-th shard a role reads from one source: from its slice of the epoch's order, or drawn by resampling."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        source: int,
        seed: int,
        epoch: int,
        role: int,
        roles: int,
        shuffle: bool,
        resampled: bool,
    ) -> None:
        self._urls = list(urls)
        self._resampled = resampled
        if resampled:
            self._draws = Draws(seed, epoch, role, RESAMPLE, source)
        else:
            self._mine = role_shards(
                urls, seed=seed, epoch=epoch, source=source, shuffle=shuffle, role=role, roles=roles
            )

    def __getitem__(self, k: int) -> str | None:
        """Shard number ``k`` (from 0), or ``None`` when the role has read all of its shards this epoch."""
        if self._resampled:
            return self._urls[min(int(self._draws[k] * len(self._urls)), len(self._urls) - 1)] if self._urls else None
        return self._mine[k] if k < len(self._mine) else None


def pick(weights: Sequence[float], active: Sequence[bool], u: float) -> int:
    """The source a draw ``u`` in ``[0, 1)`` picks among the ``active`` ones, each in proportion to its weight.

    Raises:
        ValueError: when no source is active (callers check first).
    """
    total = sum(w for w, a in zip(weights, active, strict=True) if a)
    if total <= 0:
        raise ValueError("no active source to pick from")
    target, last = u * total, -1
    for i, (w, a) in enumerate(zip(weights, active, strict=True)):
        if a:
            last = i
            target -= w
            if target < 0:
                return i
    return last  # rounding left a tiny remainder: the last active source
