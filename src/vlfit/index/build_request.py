"""What a build of an index is asked (``BuildRequest``: where, what collection, batch and shard sizes, which
process) and what it did (``BuiltIndex``); ``vlfit.index.build`` does it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlfit.errors import ConfigError
from vlfit.index.integrity import check_verify_level
from vlfit.index.manifest import IndexManifest
from vlfit.index.store import check_storage


@dataclass(frozen=True)
class BuildRequest:
    """One build of an index: where it goes, what the collection is, and how it is embedded.

    Attributes:
        output_dir: The index folder (created; an existing index is resumed and appended to).
        collection: What the source is, recorded in the manifest (``images``, or ``dataset_name``, ``split``...).
        batch_size: Images per forward pass.
        num_workers: Loader worker processes decoding and resizing (per process).
        shard_size: Items per shard (rounded up to whole batches, so a resumed build forms the same batches);
            a ``ShardCollection``'s index shards are its tar shards.
        storage: ``safetensors`` or ``npy`` (of a new index; an existing one keeps its own).
        progress: Show a progress bar (rank 0's).
        rank: This process's rank.
        world_size: How many processes build together.
        verify: How an existing index's shards are checked before the build: ``quick`` (sizes) or ``full``
            (checksums, finite embeddings); a damaged shard's items are embedded again.

    Raises:
        ConfigError: for an unknown storage or verify level, or a batch or shard size below 1.
    """

    output_dir: str
    collection: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    num_workers: int = 0
    shard_size: int = 1024
    storage: str = "safetensors"
    progress: bool = True
    rank: int = 0
    world_size: int = 1
    verify: str = "quick"

    def __post_init__(self) -> None:
        check_verify_level(self.verify)
        check_storage(self.storage)
        if self.batch_size < 1 or self.shard_size < 1:
            raise ConfigError(
                f"--batch_size and --shard_size must be at least 1, got {self.batch_size} and {self.shard_size}"
            )

    @property
    def lead(self) -> bool:
        """This process lists the shards and writes the manifest (rank 0)."""
        return self.rank == 0

    def mine(self, count: int) -> list[int]:
        """The positions of ``count`` shards this process embeds: ``rank``, ``rank + world_size``..."""
        return list(range(self.rank, count, self.world_size))


@dataclass(frozen=True)
class BuiltIndex:
    """What a build did.

    Attributes:
        manifest: The index's manifest as this process left it (rank 0: every shard of the build, as written).
        added: The rows the build added.
        bad_samples: The items it left out (``{"id", "reason"}``), after those the manifest listed already.
    """

    manifest: IndexManifest
    added: int
    bad_samples: list[dict[str, str]]


__all__ = ["BuildRequest", "BuiltIndex"]
