"""Who writes a build's shards: the one seam between ``vlfit.index.build`` (which cuts the build into shards and
lists them in the manifest) and the processes that embed and write them.

A distributor turns a build's ``ShardWork`` into the ``ShardPart`` of each shard the process running the build lists
(``vlfit.index.transaction`` records them, in position order):

- ``torch`` (the default, ``TorchRanks``): the process itself, or each of the processes torchrun started, writes
  shards ``rank``, ``rank + world_size``, ...; rank 0 gathers each round of parts and lists them.
- ``ray`` (``vlfit.index.ray_shards.RayTasks``, the ``ray`` extra): the process running the build is Ray's driver; it
  hands the shards to Ray actors, one per CPU slot of the cluster, each writing its shards as a torchrun rank does,
  and lists the parts they return.

Another engine (Spark's tasks, say) is one more class with a ``parts`` method and one more name here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.index.shard_embedding import ShardWork
from vlfit.index.transaction import ShardPart
from vlfit.inference.backends import Encoder

DISTRIBUTORS = ("torch", "ray")


class Distributor(Protocol):
    """Writes a build's shards and yields the parts the process running the build lists."""

    def parts(self, encoder: Encoder, work: ShardWork) -> Iterator[ShardPart]:
        """The parts of ``work``'s shards that this process lists (all of them, or under torchrun this rank's), each
        once; ``encoder`` is the model as this process opened it."""
        ...


class TorchRanks:
    """This process writes shards ``rank``, ``rank + world_size``, ... of the build (the request's rank and world
    size: 0 and 1 alone, torchrun's under torchrun), in order."""

    def parts(self, encoder: Encoder, work: ShardWork) -> Iterator[ShardPart]:
        request = work.request
        return work.embed(encoder, request.mine(len(work)), request.rank)


def check_distributor(name: str) -> None:
    """Refuses, in one line, a distributor that is not one of ``DISTRIBUTORS``."""
    if name not in DISTRIBUTORS:
        raise ConfigError(f"--distributor must be one of {', '.join(DISTRIBUTORS)}, got {name!r}")


def open_distributor(name: str, open_encoder: Callable[[], Encoder], address: str | None = None) -> Distributor:
    """The distributor ``name`` (``DISTRIBUTORS``).

    Args:
        name: ``torch`` or ``ray``.
        open_encoder: Opens the model in a process of the cluster (``ray``; picklable, e.g. ``IndexJob.encoder``).
        address: The Ray cluster to join (``ray``; None: ``RAY_ADDRESS`` when set, else a local cluster).

    Raises:
        ConfigError: for another name, an address given with ``torch``, or ``ray`` under torchrun.
        vlfit.errors.MissingExtraError: for ``ray`` without the ``ray`` extra.
    """
    check_distributor(name)
    if name == "torch":
        if address is not None:
            raise ConfigError("--ray_address names the Ray cluster of --distributor ray: add that flag, or drop it")
        return TorchRanks()
    from vlfit.launch import launched_world_size  # imported when needed, as the job imports it

    if launched_world_size() > 1:
        raise ConfigError(f"--distributor {name} runs its tasks from one process: start vlfit retrieve index once, "
                          "not under torchrun")  # fmt: skip
    require_extra("ray", "--distributor ray")
    from vlfit.index.ray_shards import RayTasks

    return RayTasks(open_encoder, address)


__all__ = ["DISTRIBUTORS", "Distributor", "TorchRanks", "check_distributor", "open_distributor"]
