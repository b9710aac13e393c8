"""An index's manifest (``index_manifest.json``, the layout in ``vlfit.index.store``): what the index holds.

It names the model the embeddings come from and how it ran, the shards in order with the size and SHA-256 of each
file, the items left out or removed, the collections embedded into it with their build settings, and the ANN
structure while it covers every row. It is read once per opened index (``vlfit.index.store.read_manifest``),
changed in memory by a build, and written whole, atomically and flushed to disk, after the files it names
(``write_manifest``). What may be added to an index (its embedding size, a NaFlex model's patch budget) is decided
here, from what it records.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vlfit.atomic_files import write_text_atomically
from vlfit.errors import ConfigError
from vlfit.inference.identity import ModelIdentity

MANIFEST_NAME = "index_manifest.json"


@dataclass
class IndexManifest:
    """What ``index_manifest.json`` holds.

    Attributes:
        identity: The model the embeddings come from.
        model: ``{"path", "backend", "precision", "max_seq_length"}`` of the encoder that built the index (and
            ``max_num_patches``, ``embedding_dim`` when set; its queries are embedded alike:
            ``vlfit.index.search.query_runtime``).
        storage: ``safetensors`` or ``npy``.
        shards: ``{"embeddings", "ids", "count"}`` per shard, in order (and ``"captions"``: its items' captions;
            ``"files"``: ``{name: {"bytes", "sha256"}}`` of each of its files, absent in indexes written before;
            ``"collection"``: the position in ``collections`` of the build that embedded its items, likewise).
        bad_samples: ``{"id", "reason"}`` of every item left out.
        collections: What was embedded into the index, one entry per build or append.
        removed: Ids of indexed items whose files have left their folder since (left out of results).
        ann: The description of ``ann.faiss`` when it covers every row (``vlfit.index.ann_update``), else None.
    """

    identity: ModelIdentity
    model: dict[str, str]
    storage: str = "safetensors"
    shards: list[dict[str, Any]] = field(default_factory=list)
    bad_samples: list[dict[str, str]] = field(default_factory=list)
    collections: list[dict[str, Any]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    ann: dict[str, Any] | None = None

    @property
    def count(self) -> int:
        return sum(int(shard["count"]) for shard in self.shards)

    def collection_of(self, shard: dict[str, Any]) -> dict[str, Any] | None:
        """The entry of ``collections`` whose build embedded ``shard``'s items (its ``collection``); None for a shard
        written before shards recorded it (or naming no entry there)."""
        position = shard.get("collection")
        known = isinstance(position, int) and 0 <= position < len(self.collections)
        return self.collections[position] if known else None  # type: ignore[index]

    def check_embedding_dim(self, asked: int | None, where: str) -> None:
        """Refuse, in one line, embeddings of another size than the index at ``where`` holds (``--embedding_dim
        asked``; None: the index's own, which ``RuntimeSettings.as_built`` fills in): a local index or a pushed
        collection alike."""
        size = self.identity.embedding_size
        if asked is not None and asked != size:
            raise ConfigError(
                f"--embedding_dim {asked}: the index {where} holds embeddings of size {size}; leave the flag out "
                f"to use its size, or build an index at {asked} (vlfit retrieve index --embedding_dim {asked})"
            )

    def check_appendable(self, max_num_patches: int | None, embedding_dim: int | None, where: str) -> None:
        """Refuse, in one line, to add items to the index at ``where`` embedded at another NaFlex patch budget
        (``max_num_patches``; the index's is in ``model``, none for other models' indexes: one index of two budgets
        would rank its items by which budget embedded them) or of another size (``check_embedding_dim``)."""
        built = self.model.get("max_num_patches")
        if built is not None and max_num_patches != built:
            raise ConfigError(
                f"--max_num_patches {max_num_patches} is not the {built} the index {where} was built with: its "
                "items would be embedded at two patch budgets; leave the flag out to append at the index's, or "
                "build a new index"
            )
        self.check_embedding_dim(embedding_dim, where)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": 1,
            "identity": self.identity.to_dict(),
            "model": self.model,
            "storage": self.storage,
            "count": self.count,
            "shards": self.shards,
            "bad_samples": self.bad_samples,
            "collections": self.collections,
            "removed": self.removed,
            **({"ann": self.ann} if self.ann else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexManifest:
        return cls(
            identity=ModelIdentity.from_dict(data["identity"]),
            model=dict(data["model"]),
            storage=str(data.get("storage", "safetensors")),
            shards=list(data["shards"]),
            bad_samples=list(data.get("bad_samples", [])),
            collections=list(data.get("collections", [])),
            removed=list(data.get("removed", [])),
            ann=data.get("ann"),
        )


def write_manifest(folder: str, manifest: IndexManifest) -> None:
    """Write ``index_manifest.json`` atomically and flushed to disk (after the files it names, flushed before it)."""
    text = json.dumps(manifest.to_dict(), indent=1) + "\n"
    write_text_atomically(os.path.join(folder, MANIFEST_NAME), text, durable=True)


__all__ = ["MANIFEST_NAME", "IndexManifest", "write_manifest"]
