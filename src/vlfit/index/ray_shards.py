"""A build's shards written by Ray actors (``vlfit retrieve index --distributor ray``; the ``ray`` extra).

The process running the build is Ray's driver: it joins the cluster at ``--ray_address`` (``auto``: the one ``ray
start`` started on this machine; ``ray://HOST:10001``: through Ray Client), else the one ``RAY_ADDRESS`` names (as
``ray job submit`` sets it), else starts a local one, stopped again at the end; a driver the caller connected already
(``ray.init``) is used as it is. It starts one actor per CPU slot of the cluster (at most one per shard), each opening
the model once, and hands each actor two shards at a time (the next waits while one is embedded). An actor embeds and
writes a shard's files as a torchrun rank does (``ShardWork.embed``) and returns its ``ShardPart``; the driver lists
the parts in position order (the build's transaction writes the manifest after each, so a stopped build resumes at
the first shard it does not list), and then runs the ANN step itself, once.

An actor whose process dies (its node lost, killed, out of memory) is started again and its shards handed to it again
(Ray's ``max_restarts`` and ``max_task_retries``, ``RETRIES`` times): a shard written again writes the same files,
and the driver lists each position once, so nothing is lost or listed twice. An error of the build itself (an
unreadable tar shard is a bad item as ever; a ``UserError`` such as a disk that fills) is raised in the driver as
itself.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from vlfit.errors import ConfigError, DataError, UserError, first_line
from vlfit.index.shard_embedding import ShardWork
from vlfit.index.transaction import ShardPart
from vlfit.inference.backends import Encoder

RETRIES = 3  # times an actor's process is started again after it died, and a shard handed to it again
QUEUED = 2  # shards an actor holds at a time: the next is there when one is written


class ShardWriter:
    """One Ray actor: the model, opened once in its process, and the build's work; writes the shards it is handed.

    Args:
        open_encoder: Opens the model (in the actor's process).
        work: The build's shards, in the object store (in a list: Ray leaves a reference there as it is, which an
            actor started again reads again).
        worker: The actor's number (names its fetch folder for tar shards at URLs).
    """

    def __init__(self, open_encoder: Callable[[], Encoder], work: list[Any], worker: int) -> None:
        import ray

        self.encoder = open_encoder()
        self.work: ShardWork = ray.get(work[0])
        self.worker = worker

    def write(self, position: int) -> ShardPart:
        """Embed and write shard ``position``; its part."""
        (part,) = self.work.embed(self.encoder, [position], self.worker)
        return part


class RayTasks:
    """The build's shards written by Ray actors, listed by this process (the driver).

    Args:
        open_encoder: Opens the model in each actor's process (picklable: ``IndexJob.encoder``).
        address: The cluster to join (None: ``RAY_ADDRESS`` when set, else a local cluster).
    """

    def __init__(self, open_encoder: Callable[[], Encoder], address: str | None = None) -> None:
        self.open_encoder = open_encoder
        self.address = address

    def parts(self, encoder: Encoder, work: ShardWork) -> Iterator[ShardPart]:
        """Every shard's part, in position order, as the actors write them (``encoder``, the driver's, is not
        used: each actor opens its own)."""
        import ray

        started = not ray.is_initialized()
        if started:
            _connect(self.address)
        actors: list[Any] = []
        try:
            slots = int(ray.cluster_resources().get("CPU", 1))
            writer = ray.remote(ShardWriter).options(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)
            shared = ray.put(work)  # one copy in the object store, not one per actor
            actors = [writer.remote(self.open_encoder, [shared], worker) for worker in range(min(len(work), slots))]
            yield from _in_order(actors, len(work))
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if started:
                ray.shutdown()


def _connect(address: str | None) -> None:
    """``ray.init`` at ``address``, ``RAY_ADDRESS``, or a new local cluster (without its dashboard).

    Raises:
        ConfigError: when no cluster answers at the address.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    except ConnectionError as err:
        raise ConfigError(f"--ray_address {address}: no Ray cluster answered ({first_line(err, 200)}); start one "
                          "with ray start --head, or leave the flag out for a local one") from None  # fmt: skip


def _in_order(actors: list[Any], count: int) -> Iterator[ShardPart]:
    """Hand shards 0..``count`` - 1 to ``actors`` (``QUEUED`` at a time each, the next as one is written), and yield
    their parts in position order."""
    import ray

    todo = collections.deque(range(count))
    running: dict[Any, tuple[int, Any]] = {}  # a shard's result -> its position and actor

    def hand(actor: Any) -> None:
        if todo:
            position = todo.popleft()
            running[actor.write.remote(position)] = (position, actor)

    for _ in range(QUEUED):
        for actor in actors:
            hand(actor)
    done: dict[int, ShardPart] = {}
    listed = 0
    while listed < count:
        ready, _ = ray.wait(list(running), num_returns=1)
        position, actor = running.pop(ready[0])
        done[position] = _result(ready[0], position)
        hand(actor)
        while listed in done:
            yield done.pop(listed)
            listed += 1


def _result(ref: Any, position: int) -> ShardPart:
    """The part a shard's task returned; its error as vlfit's own, or, when its actor died more than ``RETRIES``
    times, one line saying so."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, UserError):
            raise err.cause from None
        raise
    except ray.exceptions.RayActorError as err:
        raise DataError(f"shard {position} of the build: the Ray worker writing it died {RETRIES + 1} times (the "
                        f"last: {first_line(err, 200)}); the index keeps the shards its manifest lists: run the same "
                        "command again to resume") from None  # fmt: skip


__all__ = ["RETRIES", "RayTasks", "ShardWriter"]
