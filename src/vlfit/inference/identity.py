"""What makes two embeddings comparable: the same model family, embedding size and source checkpoint.

An index records the ``ModelIdentity`` of the model that built it; a query embeds with a model whose identity must
match, whatever the backend (a checkpoint in PyTorch and its exported graphs share the checkpoint's fingerprint).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import os
from dataclasses import asdict, dataclass
from typing import Any

from vlfit.errors import ConfigError, MissingFileError

# Weight files of a transformers checkpoint folder, in the order they are hashed.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
LIBRARIES = ("vlfit", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "openvino", "nncf")


class RefusedModelError(ConfigError):
    """A model, graph or index that cannot be used together with the others asked for (the message says why)."""


@dataclass(frozen=True)
class ModelIdentity:
    """Attributes:
    family: The model family's name.
    embedding_size: Size of the embeddings.
    checkpoint_sha256: Fingerprint of the source checkpoint's weights (``checkpoint_fingerprint``).
    """

    family: str
    embedding_size: int
    checkpoint_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelIdentity:
        return cls(str(data["family"]), int(data["embedding_size"]), str(data["checkpoint_sha256"]))

    def check_compatible(self, other: ModelIdentity, *, what: str, other_what: str) -> None:
        """Raise ``RefusedModelError`` unless ``other`` embeds into the same space as this identity.

        Args:
            what: Names this side in the message (``the index INDEX``).
            other_what: Names the other side (``the model MODEL``).
        """
        if self.family != other.family or self.embedding_size != other.embedding_size:
            raise RefusedModelError(
                f"{what} holds {self.family} embeddings of size {self.embedding_size} but {other_what} makes "
                f"{other.family} embeddings of size {other.embedding_size}; use the model the index was built with "
                "or build a new index"
            )
        if self.checkpoint_sha256 != other.checkpoint_sha256:
            raise RefusedModelError(
                f"{what} was built with {shown_source(self.checkpoint_sha256)} but {other_what} comes from "
                f"{shown_source(other.checkpoint_sha256)}: its embeddings are not comparable; use the model the "
                "index was built with or build a new index"
            )


def shown_source(fingerprint: str) -> str:
    """A fingerprint as a message names it: ``checkpoint`` and a SHA-256's first 12 digits, or a preset's
    ``preset:NAME`` whole (its random weights have no digest to shorten)."""
    return f"the {fingerprint}" if fingerprint.startswith("preset:") else f"checkpoint {fingerprint[:12]}"


def weight_files(checkpoint: str) -> list[str]:
    """The weight files of a checkpoint folder (sorted), or ``[]`` when there are none."""
    for pattern in WEIGHT_PATTERNS:
        files = sorted(glob.glob(os.path.join(checkpoint, pattern)))
        if files:
            return files
    return []


def checkpoint_fingerprint(checkpoint: str) -> str:
    """SHA-256 over the names and bytes of a checkpoint folder's weight files.

    Raises:
        FileNotFoundError: when the folder holds no weight files.
    """
    files = weight_files(checkpoint)
    if not files:
        raise MissingFileError(
            f"{checkpoint}: no model weights ({' or '.join(WEIGHT_PATTERNS)}) found; pass a checkpoint folder "
            "that vlfit train wrote"
        )
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def weights_mtime(checkpoint: str) -> float:
    """Latest modification time of a checkpoint's weight files (0 when there are none)."""
    return max((os.path.getmtime(path) for path in weight_files(checkpoint)), default=0.0)


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries an export depends on (``missing`` for one not installed)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions
