"""An index's manifest (``index_manifest.json``, the layout in ``vlfit.index.store``): what the index holds.

It names the model the embeddings come from and how it ran, the shards in order with the size and SHA-256 of each
file, the items left out or removed, the collections embedded into it with their build settings, and the ANN
structure while it covers every row. It is read once per opened index (``read_manifest``), changed in memory by a
build, and written whole, atomically and flushed to disk, after the files it names (``write_manifest``). What may be
added to an index (its embedding size, a NaFlex model's patch budget) and the command that rebuilds a damaged one
are decided here, from what it records.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from vlfit.atomic_files import write_text_atomically
from vlfit.data.sources.openers import COLLECTION_KEYS
from vlfit.errors import ConfigError, MissingFileError
from vlfit.index.integrity import DamagedIndexError
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
            ``"files"``: ``{name: {"bytes", "sha256"}}`` of each of its files, absent in indexes written before).
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


def read_manifest(folder: str) -> IndexManifest:
    """The manifest of the index at ``folder``.

    Raises:
        MissingFileError: when the folder holds none.
        DamagedIndexError: naming the file and the command that rebuilds the index, when it does not parse.
    """
    manifest_path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        raise MissingFileError(f"--index {folder}: no {MANIFEST_NAME}; build one with vlfit retrieve index")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = IndexManifest.from_dict(json.load(f))
        for shard in manifest.shards:
            if not (isinstance(shard.get("embeddings"), str) and isinstance(shard.get("ids"), str)):
                raise ValueError(f"a shard entry without its files: {shard}")
            shard["count"] = int(shard["count"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # JSONDecodeError, UnicodeDecodeError too
        problem = f"does not parse ({type(err).__name__}: {err})"
        raise DamagedIndexError(manifest_path, problem, rebuild_command(folder)) from None
    return manifest


def write_manifest(folder: str, manifest: IndexManifest) -> None:
    """Write ``index_manifest.json`` atomically and flushed to disk (after the files it names, flushed before it)."""
    text = json.dumps(manifest.to_dict(), indent=1) + "\n"
    write_text_atomically(os.path.join(folder, MANIFEST_NAME), text, durable=True)


def rebuild_command(
    folder: str,
    model: dict[str, Any] | None = None,
    collections: list[dict[str, Any]] | None = None,
    *,
    full: bool = False,
) -> str:
    """The command that rebuilds what is damaged in the index at ``folder``: ``vlfit retrieve index`` over the same
    folder with the model and collection its manifest records (``full``: with ``--verify full``, for damage only a
    checksum shows). Without them (the manifest itself is damaged), a build into a new folder."""
    if not model or not collections:
        return (
            "vlfit retrieve index --model MODEL --images FOLDER (or --dataset_name DATA) --output_dir NEW_FOLDER "
            "(the manifest lists what the index holds: without it, build the index again)"
        )
    flags = ["--model", str(model.get("path", "MODEL"))]
    last = collections[-1]
    for key in COLLECTION_KEYS:  # the flags of vlfit retrieve index that open it again
        if last.get(key) is not None:
            flags += [f"--{key}", str(last[key])]
    flags += ["--output_dir", folder]
    if full:
        flags += ["--verify", "full"]
    return "vlfit retrieve index " + " ".join(shlex.quote(flag) for flag in flags)


__all__ = ["MANIFEST_NAME", "IndexManifest", "read_manifest", "rebuild_command", "write_manifest"]
