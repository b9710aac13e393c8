"""Encoders that embed images and captions on PyTorch, ONNX Runtime or OpenVINO, behind one interface.

Each takes what the fast CPU pipeline makes, uint8 pixels ``[B, 3, H, W]`` (``encode_images``) and token ids with
their attention mask (``encode_tokens``; ``encode_texts`` tokenizes captions first), and returns L2-normalized
float32 embeddings on the CPU.

Two doors, each taking what ``vlfit.models.reference.parse_model_reference`` parsed: ``open_encoder`` (a checkpoint
or LoRA adapters on PyTorch, a folder ``vlfit export`` wrote on the runtime of its format, or a preset: what every
command and ``vlfit.load`` embed with) and ``load_checkpoint`` (a checkpoint on PyTorch, its model and towers at
hand: what ``vlfit export`` traces and ``vlfit fewshot`` tunes).
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.inference.exported import TOKENIZER_FILES, ExportFolder
from vlfit.inference.identity import ModelIdentity, RefusedModelError, checkpoint_fingerprint
from vlfit.inference.towers import IMAGE_INPUT, TEXT_INPUTS, ImageTower, TextTower
from vlfit.models.family import InputSpec
from vlfit.models.reference import ModelReference, parse_model_reference

if TYPE_CHECKING:
    from torch import nn

    from vlfit.models.loading import LoadedModel

# The caption length vlfit train truncates to by default (--max_seq_length).
DEFAULT_MAX_SEQ_LENGTH = 128
# What a model folder can be (a preset is not a folder: open_encoder takes one too).
FOLDER_KINDS = ("checkpoint", "adapters", "export")
BACKENDS = ("auto", "torch", "onnxruntime", "openvino")
PRECISION_CHOICES = ("auto", "fp32", "int8")


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
    def encode_images(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        """uint8 pixels ``[B, 3, H, W]`` -> float32 ``[B, D]``."""

    @abstractmethod
    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, S]`` twice -> float32 ``[B, D]``."""

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask of ``texts``, truncated and padded as the collator does."""
        return self.spec.tokenize(texts)

    def encode_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """Caption strings -> float32 ``[len(texts), D]``."""
        tokens = self.tokenize(texts)
        return self.encode_tokens(tokens["input_ids"], tokens["attention_mask"])

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
    """A loaded model on PyTorch (fp32, eval mode), through the family's towers (``load_checkpoint`` makes one).

    Args:
        loaded: The model with its spec (put in eval mode and fp32 here; its towers use it, not a copy: changes to
            its weights show).
        model_path: What the model is called (its folder, or ``preset:NAME`` for a preset's random weights).
        fingerprint: What identifies its weights (``checkpoint_fingerprint`` of a folder).
        num_threads: torch threads (``None``: torch's default).

    Attributes:
        loaded: The model with its spec.
        image_tower: uint8 pixels -> embeddings (what ``vlfit export`` traces).
        text_tower: Token ids and mask -> embeddings.
    """

    backend = "torch"
    precision = "fp32"

    def __init__(self, loaded: LoadedModel, model_path: str, fingerprint: str, num_threads: int | None = None) -> None:
        model = loaded.model.eval().float()
        self.loaded = loaded
        self.model_path = model_path
        self.spec = loaded.inputs
        self.image_tower = ImageTower(loaded.family, model, loaded.inputs).eval()
        self.text_tower = TextTower(loaded.family, model).eval()
        with torch.inference_mode():
            probe = self.text_tower(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
        self.identity = ModelIdentity(loaded.family.name, int(probe.shape[-1]), fingerprint)
        if num_threads:
            torch.set_num_threads(num_threads)

    @property
    def model(self) -> nn.Module:
        """The model the towers run."""
        return self.loaded.model

    def save(self, folder: str) -> None:
        """Save the model with its tokenizer and image processor into ``folder`` (``LoadedModel.save``)."""
        self.loaded.save(folder)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(pixels) if isinstance(pixels, np.ndarray) else pixels
        return self.image_tower(tensor).float()

    @torch.inference_mode()
    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text_tower(input_ids, attention_mask).float()


class _ExportedEncoder(Encoder):
    def __init__(self, exported: ExportFolder, precision: str) -> None:
        if precision == "auto":
            precision = "int8" if "int8" in exported.precisions else "fp32"
        self.precision = precision
        self.model_path = exported.path
        self.exported = exported
        self.spec = exported.input_spec()
        self.identity = exported.identity


def onnx_session(path: str, num_threads: int | None = None, allow_spinning: bool = True) -> Any:
    """An ONNX Runtime session of the graph at ``path`` on the CPU (``num_threads`` intra-op threads, ``None``: its
    default; ``allow_spinning``: see ``OnnxRuntimeEncoder``)."""
    require_extra("export", "the onnxruntime backend", ("onnxruntime",))
    import onnxruntime as ort

    options = ort.SessionOptions()
    if num_threads:
        options.intra_op_num_threads = num_threads
    if not allow_spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def openvino_model(path: str, inference_precision: str | None = None, num_threads: int | None = None) -> Any:
    """The graph at ``path`` compiled on OpenVINO's CPU plugin (``inference_precision``: its
    ``INFERENCE_PRECISION_HINT``, ``None`` for the plugin's default; ``num_threads``: ``INFERENCE_NUM_THREADS``,
    ``None`` for its default). Every graph is compiled by one ``openvino.Core`` per process, as OpenVINO advises."""
    require_extra("export", "the openvino backend", ("openvino",))
    config: dict[str, Any] = {}
    if inference_precision:
        config["INFERENCE_PRECISION_HINT"] = inference_precision
    if num_threads:
        config["INFERENCE_NUM_THREADS"] = num_threads
    return _openvino_core().compile_model(path, "CPU", config)


@functools.cache
def _openvino_core() -> Any:
    import openvino as ov

    return ov.Core()


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
        exported: ExportFolder,
        precision: str = "auto",
        num_threads: int | None = None,
        allow_spinning: bool = True,
    ) -> None:
        require_extra("export", "the onnxruntime backend", ("onnxruntime",))  # before the folder is read
        super().__init__(exported, precision)
        self.sessions = {
            tower: onnx_session(exported.graph_path(tower, self.precision), num_threads, allow_spinning)
            for tower in ("image", "text")
        }

    def encode_images(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        (out,) = self.sessions["image"].run(None, {IMAGE_INPUT: _as_numpy_uint8(pixels)})
        return torch.from_numpy(out).float()

    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
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
        exported: ExportFolder,
        precision: str = "auto",
        inference_precision: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        require_extra("export", "the openvino backend", ("openvino",))  # before the folder is read
        super().__init__(exported, precision)
        self.compiled = {
            tower: openvino_model(exported.graph_path(tower, self.precision), inference_precision, num_threads)
            for tower in ("image", "text")
        }

    def encode_images(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        compiled = self.compiled["image"]
        return torch.from_numpy(np.asarray(compiled({IMAGE_INPUT: _as_numpy_uint8(pixels)})[compiled.output(0)]))

    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        compiled = self.compiled["text"]
        feeds = _text_feeds(input_ids, attention_mask)
        return torch.from_numpy(np.asarray(compiled(feeds)[compiled.output(0)])).float()


def open_encoder(
    model: str | ModelReference,
    backend: str = "auto",
    precision: str = "auto",
    *,
    num_threads: int | None = None,
    inference_precision: str | None = None,
    allow_spinning: bool = True,
) -> Encoder:
    """The encoder of a checkpoint folder, an export folder or a preset: the one way a model is opened to embed
    with (``vlfit.load``, ``vlfit serve``, indexing and querying, few-shot classifiers).

    Args:
        model: A checkpoint folder (LoRA adapters included), a folder ``vlfit export`` wrote, or a preset (its name
            or its ``.json`` file: random weights, with a byte-level tokenizer trained on ``vlfit make-data``'s
            caption grammar); or what it parsed to (``parse_model_reference``).
        backend: ``auto`` (the folder's own), ``torch``, ``onnxruntime`` or ``openvino``.
        precision: For exported graphs: ``auto`` (INT8 when present), ``fp32`` or ``int8``.
        num_threads: Threads of the runtime.
        inference_precision: OpenVINO's ``INFERENCE_PRECISION_HINT`` (``None``: the plugin's default).
        allow_spinning: ONNX Runtime: idle threads spin-wait (see ``OnnxRuntimeEncoder``).

    Raises:
        ConfigError: for an unknown backend or precision, fewer than one thread, or a preset on another runtime.
        MissingFileError: for a path that is neither a folder nor a preset.
        RefusedModelError: for a combination that cannot run (a checkpoint on ONNX Runtime, an ONNX export on
            OpenVINO...), a missing tokenizer, graphs older than their checkpoint, or a precision not exported.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if precision not in PRECISION_CHOICES:
        raise ConfigError(f"unknown --precision {precision!r}; choose one of: {', '.join(PRECISION_CHOICES)}")
    if num_threads is not None and num_threads < 1:
        raise ConfigError(f"--num_threads must be at least 1, got {num_threads}")
    if not isinstance(model, ModelReference):
        model = parse_model_reference(model, flag="--model", kinds=("preset", *FOLDER_KINDS))
    if model.kind == "preset":
        if backend not in ("auto", "torch"):
            raise ConfigError(
                f"preset {model.path} runs on torch; export a trained checkpoint for --backend {backend!r}"
            )
        return _preset_encoder(model.path, num_threads)
    other = "onnx" if backend == "onnxruntime" else "openvino"
    if model.kind != "export":
        if backend not in ("auto", "torch"):
            raise RefusedModelError(
                f"{model.path} is a checkpoint, which runs on torch; for --backend {backend} export it first with "
                f"vlfit export --model_name_or_path {model.path} --format {other}"
            )
        if precision == "int8":
            raise RefusedModelError(f"{model.path}: INT8 runs on exported graphs only; export with --quantize int8")
        return _torch_encoder(model, DEFAULT_MAX_SEQ_LENGTH, num_threads)
    exported = ExportFolder.open(model.path, check_source=False)
    exported.check_backend(backend)
    exported.check_source_unchanged()
    if exported.runtime == "onnxruntime":
        return OnnxRuntimeEncoder(exported, precision, num_threads=num_threads, allow_spinning=allow_spinning)
    return OpenVinoEncoder(exported, precision, inference_precision=inference_precision, num_threads=num_threads)


def load_checkpoint(
    path: str, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH, *, flag: str = "--model_name_or_path"
) -> TorchEncoder:
    """A local checkpoint folder (LoRA adapters included) on PyTorch, its model and towers at hand.

    Args:
        path: The checkpoint folder.
        max_seq_length: Longest tokenized caption.
        flag: The option that named the folder, for error messages.

    Raises:
        MissingFileError: naming ``flag``, when the folder or its weights do not exist.
        RefusedModelError: when the folder has no tokenizer.
    """
    reference = parse_model_reference(path, flag=flag, kinds=("checkpoint", "adapters"))
    return _torch_encoder(reference, max_seq_length, None)


def _torch_encoder(reference: ModelReference, max_seq_length: int, num_threads: int | None) -> TorchEncoder:
    """A checkpoint folder on PyTorch: fp32, eval mode, the sdpa attention path."""
    from vlfit.models.loading import load_model  # only here: it imports transformers' models

    folder = reference.path
    if reference.answers_questions:
        raise RefusedModelError(
            f"{folder} is a question-answering model (vlfit train --task vqa): it has no contrastive heads to embed "
            f"with; ask it questions (vlfit vqa --model {folder}, or vlfit.load(...).answer), or embed with a "
            "contrastive checkpoint"
        )
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise RefusedModelError(
            f"{folder}: the checkpoint has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save one beside the weights "
            "(vlfit train does)"
        )
    loaded = load_model(model_name_or_path=reference, max_seq_length=max_seq_length)
    return TorchEncoder(loaded, folder, checkpoint_fingerprint(folder), num_threads)


def _preset_encoder(preset: str, num_threads: int | None) -> TorchEncoder:
    from vlfit.data.synthetic.scenes import scene_and_choices
    from vlfit.models.loading import load_model

    rng = np.random.default_rng(0)
    captions = [caption for _ in range(64) for caption in scene_and_choices(rng)[1]]
    loaded = load_model(model_preset=preset, captions=lambda: captions, max_seq_length=DEFAULT_MAX_SEQ_LENGTH)
    return TorchEncoder(loaded, f"preset:{preset}", f"preset:{preset}", num_threads)
