"""One build of an index as a transaction over its manifest (``vlfit.index.build`` embeds, this records).

The manifest is read once (the ``EmbeddingIndex`` the caller opened), changed in memory as the build goes, and
written from here alone, by rank 0, at the points where every file it lists is on disk: after each round of shards
(a build stopped later resumes from there) and, when no round wrote it, at the end. The files of shards it stops
naming (the damaged ones a repair replaced) are removed only once a manifest without them is written, and under
torchrun rank 0 writes only after every process has read what it replaces (a round's gather, or a barrier). The
result (``BuiltIndex``) holds the manifest as built, which the ANN step (``vlfit.index.ann_update``) takes as it is.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from vlfit.index.build_request import BuildRequest, BuiltIndex
from vlfit.index.manifest import IndexManifest, write_manifest


@dataclass(frozen=True)
class ShardPart:
    """What one process made of one shard of a build: its manifest entry (None when every image was bad), and
    the items it left out."""

    position: int
    entry: dict[str, Any] | None
    bad_samples: list[dict[str, str]]


class BuildTransaction:
    """The manifest of one build of the index at ``request.output_dir``, from its state before the build to the
    index it leaves.

    Args:
        request: The build (its folder, and which process this is).
        manifest: The index's manifest as read (or begun, for a new index), with what the build found done already
            (repaired, retried, removed items); the build adds its shards to it in place.
        replaced: Shard entries taken off the manifest (damaged ones that were repaired): their files are removed
            once a manifest without them is written.
        collection: The position of the build's entry in the manifest's ``collections``, recorded in each shard it
            lists (``collection``), so a repair knows where the shard's items came from.
    """

    def __init__(
        self,
        request: BuildRequest,
        manifest: IndexManifest,
        replaced: list[dict[str, Any]] | None = None,
        collection: int | None = None,
    ) -> None:
        self.request = request
        self.manifest = manifest
        self.collection = collection
        self.rounds = 0
        self._count_before, self._bad_before = manifest.count, len(manifest.bad_samples)
        self._replaced = [name for shard in replaced or [] for name in
                          (shard["embeddings"], shard["ids"], shard.get("captions")) if name]  # fmt: skip

    def record(self, part: ShardPart | None) -> list[ShardPart]:
        """One round: every process's part (None: it had no shard this round) is gathered on rank 0, which lists the
        round's shards in order and writes the manifest (a build stopped in between redoes them). Returns the parts
        listed (rank 0; none elsewhere)."""
        self.rounds += 1
        parts = self._gather(part)
        for done in sorted(parts, key=lambda p: p.position):
            self.manifest.bad_samples.extend(done.bad_samples)
            if done.entry is not None:
                if self.collection is not None:  # which collection its items came from: a repair needs it
                    done.entry["collection"] = self.collection
                self.manifest.shards.append(done.entry)
        if parts:
            self._write()
        return parts

    def commit(self) -> BuiltIndex:
        """The end of the build: the manifest written if no round wrote it (the collection recorded, retried and
        removed items, repairs), and what the build did."""
        manifest = self.manifest
        built = BuiltIndex(manifest, manifest.count - self._count_before, manifest.bad_samples[self._bad_before :])
        if not self.rounds:
            if self.request.world_size > 1:
                import torch.distributed as dist

                dist.barrier()  # every process has read the manifest and the shards before rank 0 rewrites them
            if self.request.lead:
                self._write()
        return built

    def _write(self) -> None:
        """Write the manifest, then remove the files it no longer names."""
        write_manifest(self.request.output_dir, self.manifest)
        for name in self._replaced:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.request.output_dir, name))
        self._replaced = []

    def _gather(self, part: ShardPart | None) -> list[ShardPart]:
        """Every process's part of one round, on rank 0 (an empty list elsewhere)."""
        if self.request.world_size == 1:
            return [part] if part is not None else []
        import torch.distributed as dist

        parts: list[ShardPart | None] | None = [None] * self.request.world_size if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0)
        return [p for p in parts or [] if p is not None]


__all__ = ["BuildTransaction", "ShardPart"]
