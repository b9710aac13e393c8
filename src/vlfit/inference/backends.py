"""Encoders that embed images and captions on PyTorch, ONNX Runtime or OpenVINO, behind one interface.

Each takes what the fast CPU pipeline makes, uint8 pixels ``[B, 3, H, W]`` and token ids with their attention
mask, and returns L2-normalized float32 embeddings on the CPU. ``open_encoder`` picks the backend: a checkpoint
folder runs on PyTorch, a folder ``vlfit export`` wrote runs on the runtime of its format (``auto``).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vlfit.errors import ConfigError, MissingFileError
from vlfit.extras import require_extra
from vlfit.inference.exported import ExportedModel, is_exported_model
from vlfit.inference.identity import ModelIdentity, RefusedModelError
from vlfit.inference.towers import IMAGE_INPUT, TEXT_INPUTS
from vlfit.models.family import InputSpec

if TYPE_CHECKING:
    from vlfit.inference.loading import LoadedCheckpoint

BACKENDS = ("auto", "torch", "onnxruntime", "openvino")
PRECISION_CHOICES = ("auto", "fp32", "int8")
_FORMAT_BACKEND = {"onnx": "onnxruntime", "openvino": "openvino"}


class Encoder(ABC):
    """Embeds uint8 images and tokenized captions.

    Attributes:
        backend: ``torch``, ``onnxruntime`` or ``openvino``.
        precision: ``fp32`` or ``int8`` (PyTorch: ``fp32``).
        model_path: The checkpoint or export folder.
        spec: Image size, mean, std, tokenizer and caption length.
        identity: What the embeddings are comparable with.
    """

    backend: str
    precision: str
    model_path: str
    spec: InputSpec
    identity: ModelIdentity

    @abstractmethod
    def embed_pixels(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        """uint8 ``[B, 3, H, W]`` -> float32 ``[B, D]``."""

    @abstractmethod
    def embed_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, S]`` twice -> float32 ``[B, D]``."""

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask of ``texts``, truncated and padded as the collator does."""
        return self.spec.tokenize(texts)

    def embed_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """Caption strings -> float32 ``[len(texts), D]``."""
        tokens = self.tokenize(texts)
        return self.embed_tokens(tokens["input_ids"], tokens["attention_mask"])

    @property
    def description(self) -> str:
        return f"{self.model_path} on {self.backend} ({self.precision})"


def _as_numpy_uint8(pixels: torch.Tensor | np.ndarray) -> np.ndarray:
    array = pixels.numpy() if isinstance(pixels, torch.Tensor) else pixels
    if array.dtype != np.uint8:
        raise ValueError(f"the image graphs take uint8 pixels, got {array.dtype}")
    return np.ascontiguousarray(array)


def _text_feeds(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, np.ndarray]:
    ids_name, mask_name = TEXT_INPUTS
    return {ids_name: input_ids.numpy().astype(np.int64), mask_name: attention_mask.numpy().astype(np.int64)}


class TorchEncoder(Encoder):
    """A checkpoint on PyTorch (fp32, eager), through the family's towers.

    Args:
        model_path: A checkpoint folder (``vlfit train``'s output).
        num_threads: torch threads (``None``: torch's default).
        loaded: The checkpoint already loaded (its towers are used, not copied: changes to their weights show).
    """

    backend = "torch"
    precision = "fp32"

    def __init__(self, model_path: str, num_threads: int | None = None, loaded: LoadedCheckpoint | None = None) -> None:
        if loaded is None:
            from vlfit.inference.loading import load_checkpoint  # only here: it imports transformers' models

            loaded = load_checkpoint(model_path, flag="--model")
        self.model_path = model_path
        self.spec = loaded.spec
        self.identity = loaded.identity
        self.image_tower = loaded.image_tower
        self.text_tower = loaded.text_tower
        if num_threads:
            torch.set_num_threads(num_threads)

    @torch.inference_mode()
    def embed_pixels(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(pixels) if isinstance(pixels, np.ndarray) else pixels
        return self.image_tower(tensor).float()

    @torch.inference_mode()
    def embed_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text_tower(input_ids, attention_mask).float()


class _ExportedEncoder(Encoder):
    def __init__(self, exported: ExportedModel, precision: str) -> None:
        if precision == "auto":
            precision = "int8" if "int8" in exported.precisions else "fp32"
        self.precision = precision
        self.model_path = exported.path
        self.exported = exported
        self.spec = exported.input_spec()
        self.identity = exported.identity


class OnnxRuntimeEncoder(_ExportedEncoder):
    """An exported ONNX folder on ONNX Runtime's CPU provider.

    Args:
        exported: The export folder.
        precision: ``fp32``, ``int8`` or ``auto`` (INT8 when exported).
        num_threads: Intra-op threads (``None``: ONNX Runtime's default, one per physical core).
        allow_spinning: Let idle intra-op threads spin-wait for the next call (ONNX Runtime's default: lowest
            latency for back-to-back calls). A server turns it off: spinning threads take the cores its event loop
            needs (on 2 cores at 8 concurrent queries: about 260 QPS with it, about 400 without).
    """

    backend = "onnxruntime"

    def __init__(
        self,
        exported: ExportedModel,
        precision: str = "auto",
        num_threads: int | None = None,
        allow_spinning: bool = True,
    ) -> None:
        require_extra("export", "the onnxruntime backend", ("onnxruntime",))
        import onnxruntime as ort

        super().__init__(exported, precision)
        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
        if not allow_spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.sessions = {
            tower: ort.InferenceSession(
                exported.graph_path(tower, self.precision), options, providers=["CPUExecutionProvider"]
            )
            for tower in ("image", "text")
        }

    def embed_pixels(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        (out,) = self.sessions["image"].run(None, {IMAGE_INPUT: _as_numpy_uint8(pixels)})
        return torch.from_numpy(out).float()

    def embed_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        feeds = _text_feeds(input_ids, attention_mask)
        (out,) = self.sessions["text"].run(None, feeds)
        return torch.from_numpy(out).float()


class OpenVinoEncoder(_ExportedEncoder):
    """An exported OpenVINO folder on the CPU plugin.

    Args:
        exported: The export folder.
        precision: ``fp32``, ``int8`` or ``auto`` (INT8 when exported).
        inference_precision: The plugin's ``INFERENCE_PRECISION_HINT``: ``f32``, or ``None`` for the plugin's
            default (bf16 on CPUs that have it).
        num_threads: ``INFERENCE_NUM_THREADS`` (``None``: the plugin's default).
    """

    backend = "openvino"

    def __init__(
        self,
        exported: ExportedModel,
        precision: str = "auto",
        inference_precision: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        require_extra("export", "the openvino backend", ("openvino",))
        import openvino as ov

        super().__init__(exported, precision)
        config: dict[str, Any] = {}
        if inference_precision:
            config["INFERENCE_PRECISION_HINT"] = inference_precision
        if num_threads:
            config["INFERENCE_NUM_THREADS"] = num_threads
        core = ov.Core()
        self.compiled = {
            tower: core.compile_model(exported.graph_path(tower, self.precision), "CPU", config)
            for tower in ("image", "text")
        }

    def embed_pixels(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        compiled = self.compiled["image"]
        return torch.from_numpy(np.asarray(compiled({IMAGE_INPUT: _as_numpy_uint8(pixels)})[compiled.output(0)]))

    def embed_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        compiled = self.compiled["text"]
        feeds = _text_feeds(input_ids, attention_mask)
        return torch.from_numpy(np.asarray(compiled(feeds)[compiled.output(0)])).float()


def resolve_backend(model_path: str, backend: str = "auto") -> str:
    """The backend ``open_encoder`` would use for ``model_path``.

    Raises:
        RefusedModelError: for a backend the folder cannot run on (a checkpoint on ONNX Runtime, an ONNX export on
            OpenVINO...).
        ValueError: for an unknown backend.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if not os.path.isdir(model_path):
        raise MissingFileError(
            f"--model {model_path}: no such model folder ({os.path.abspath(model_path)} does not exist)"
        )
    if is_exported_model(model_path):
        fmt = ExportedModel.open(model_path, check_source=False).format
        native = _FORMAT_BACKEND[fmt]
        if backend not in ("auto", native):
            raise RefusedModelError(
                f"{model_path} holds {fmt} graphs, which run on {native}, not {backend}; use --backend {native} "
                f"(or auto), or export with --format {'onnx' if backend == 'onnxruntime' else 'openvino'}"
            )
        return native
    if backend not in ("auto", "torch"):
        raise RefusedModelError(
            f"{model_path} is a checkpoint, which runs on torch; for --backend {backend} export it first with "
            f"vlfit export --model_name_or_path {model_path} --format "
            f"{'onnx' if backend == 'onnxruntime' else 'openvino'}"
        )
    return "torch"


def open_encoder(
    model_path: str,
    backend: str = "auto",
    precision: str = "auto",
    *,
    num_threads: int | None = None,
    inference_precision: str | None = None,
    allow_spinning: bool = True,
) -> Encoder:
    """The encoder of a checkpoint or export folder.

    Args:
        model_path: A checkpoint folder or a folder ``vlfit export`` wrote.
        backend: ``auto`` (the folder's own), ``torch``, ``onnxruntime`` or ``openvino``.
        precision: For exported graphs: ``auto`` (INT8 when present), ``fp32`` or ``int8``.
        num_threads: Threads of the runtime.
        inference_precision: OpenVINO's ``INFERENCE_PRECISION_HINT`` (``None``: the plugin's default).
        allow_spinning: ONNX Runtime: idle threads spin-wait (see ``OnnxRuntimeEncoder``).

    Raises:
        RefusedModelError: for a combination that cannot run (see ``resolve_backend``), a missing tokenizer, graphs
            older than their checkpoint, or a precision that was not exported.
    """
    if precision not in PRECISION_CHOICES:
        raise ConfigError(f"unknown --precision {precision!r}; choose one of: {', '.join(PRECISION_CHOICES)}")
    chosen = resolve_backend(model_path, backend)
    if chosen == "torch":
        if precision == "int8":
            raise RefusedModelError(f"{model_path}: INT8 runs on exported graphs only; export with --quantize int8")
        return TorchEncoder(model_path, num_threads=num_threads)
    exported = ExportedModel.open(model_path)
    if chosen == "onnxruntime":
        return OnnxRuntimeEncoder(exported, precision, num_threads=num_threads, allow_spinning=allow_spinning)
    return OpenVinoEncoder(exported, precision, inference_precision=inference_precision, num_threads=num_threads)


def load_encoder(
    path_or_preset: str,
    backend: str = "auto",
    *,
    precision: str = "auto",
    num_threads: int | None = None,
    allow_spinning: bool = True,
) -> Encoder:
    """The encoder of a checkpoint folder, an export folder or a preset (what ``vlfit.load`` and ``vlfit serve``
    embed with).

    Args:
        path_or_preset: A checkpoint folder (LoRA adapters included), a folder ``vlfit export`` wrote, or a preset
            (its name or its ``.json`` file: random weights, with a byte-level tokenizer trained on
            ``vlfit make-data``'s caption grammar).
        backend: ``auto``, ``torch``, ``onnxruntime`` or ``openvino`` (see ``open_encoder``).
        precision: Exported graphs: ``auto`` (INT8 when exported), ``fp32`` or ``int8``.
        num_threads: Threads of the runtime (``None``: its default).
        allow_spinning: ONNX Runtime's idle threads spin-wait for the next call.

    Raises:
        ConfigError: for an unknown backend or precision, fewer than one thread, or a preset on another runtime.
        MissingFileError: for a path that is neither a folder nor a preset.
    """
    from vlfit.models.presets import is_preset_file, list_presets

    if backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if precision not in PRECISION_CHOICES:
        raise ConfigError(f"unknown --precision {precision!r}; choose one of: {', '.join(PRECISION_CHOICES)}")
    if num_threads is not None and num_threads < 1:
        raise ConfigError(f"--num_threads must be at least 1, got {num_threads}")
    presets = list_presets()
    preset = path_or_preset in presets and not os.path.exists(path_or_preset)
    if preset or (is_preset_file(path_or_preset) and os.path.isfile(path_or_preset)):  # a name, or a preset file
        if backend not in ("auto", "torch"):
            raise ConfigError(
                f"preset {path_or_preset} runs on torch; export a trained checkpoint for --backend {backend!r}"
            )
        return _preset_encoder(path_or_preset, num_threads)
    if not os.path.exists(path_or_preset):
        raise MissingFileError(
            f"--model {path_or_preset}: no such model folder, and not a preset (one of: "
            f"{', '.join(presets)}; or a preset .json file)"
        )
    return open_encoder(path_or_preset, backend, precision, num_threads=num_threads, allow_spinning=allow_spinning)


def _preset_encoder(preset: str, num_threads: int | None) -> TorchEncoder:
    from vlfit.data.synthetic.scenes import scene_and_choices
    from vlfit.inference.loading import DEFAULT_MAX_SEQ_LENGTH, loaded_bundle
    from vlfit.models.loading import load_model_bundle

    rng = np.random.default_rng(0)
    captions = [caption for _ in range(64) for caption in scene_and_choices(rng)[1]]
    bundle = load_model_bundle(model_preset=preset, captions=lambda: captions, max_seq_length=DEFAULT_MAX_SEQ_LENGTH)
    loaded = loaded_bundle(f"preset:{preset}", bundle, f"preset:{preset}")
    return TorchEncoder(loaded.path, num_threads=num_threads, loaded=loaded)
