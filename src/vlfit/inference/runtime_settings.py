"""How a model is run (``RuntimeSettings``): one setting for every part of a ``ModelRuntime``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vlfit.errors import ConfigError

BACKENDS = ("auto", "torch", "onnxruntime", "openvino")
PRECISION_CHOICES = ("auto", "fp32", "int8", "bf16")


@dataclass(frozen=True)
class RuntimeSettings:
    """How a model is run: one setting for all its parts.

    Attributes:
        backend: ``auto`` (the folder's own runtime), ``torch``, ``onnxruntime`` or ``openvino``.
        precision: ``auto`` (INT8 when exported), ``fp32`` or ``int8`` (exported graphs only), or ``bf16`` (an
            OpenVINO export's fp32 graphs computed in bf16, on a CPU with bf16 matrix units).
        num_threads: Threads of the runtime (``None``: its default), for the encoder, the pair scorer and the
            answerer alike.
        max_seq_length: Caption length (``None``: the one the run was trained with).
        inference_precision: OpenVINO's ``INFERENCE_PRECISION_HINT`` (``None``: the plugin's default).
        allow_spinning: ONNX Runtime's idle threads spin-wait for the next call (a server turns it off).
        max_num_patches: A NaFlex model's token budget per image (``None``: the one the run was trained with).
        embedding_dim: Keep the first this many dimensions of each embedding, L2-normalized again (``None``: all of
            them); the encoder applies it, so every door's embeddings are of this size.
    """

    backend: str = "auto"
    precision: str = "auto"
    num_threads: int | None = None
    max_seq_length: int | None = None
    inference_precision: str | None = None
    allow_spinning: bool = True
    max_num_patches: int | None = None
    embedding_dim: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown --backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}")
        if self.precision not in PRECISION_CHOICES:
            raise ConfigError(f"unknown --precision {self.precision!r}; choose one of: {', '.join(PRECISION_CHOICES)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--num_threads must be at least 1, got {self.num_threads}")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise ConfigError(f"--max_seq_length must be at least 1, got {self.max_seq_length}")
        if self.max_num_patches is not None and self.max_num_patches < 1:
            raise ConfigError(f"--max_num_patches must be at least 1, got {self.max_num_patches}")
        if self.embedding_dim is not None and self.embedding_dim < 1:
            raise ConfigError(f"--embedding_dim must be at least 1, got {self.embedding_dim}")

    def as_built(self, built: Mapping[str, Any]) -> RuntimeSettings:
        """These settings with what was left unset (``auto``, ``None``) taken from how an index's items were embedded
        (its manifest's ``model`` record: backend, precision, caption length, patch budget, embedding size), so its
        queries are embedded alike."""
        return replace(
            self,
            backend=built["backend"] if self.backend == "auto" else self.backend,
            precision=built.get("precision", "auto") if self.precision == "auto" else self.precision,
            max_seq_length=self.max_seq_length or built.get("max_seq_length"),
            max_num_patches=self.max_num_patches or built.get("max_num_patches"),
            embedding_dim=self.embedding_dim or built.get("embedding_dim"),
        )
