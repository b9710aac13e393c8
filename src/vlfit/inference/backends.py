"""Encoders that embed images and captions on PyTorch, ONNX Runtime or OpenVINO, behind one interface.

Each takes what the fast CPU pipeline makes, uint8 pixels ``[B, 3, H, W]`` (``encode_images``) and token ids with
their attention mask (``encode_tokens``; ``encode_texts`` tokenizes captions first), and returns L2-normalized
float32 embeddings on the CPU.

``build_encoder`` builds one from what ``vlfit.models.reference.parse_model_reference`` parsed (a checkpoint or
LoRA adapters on PyTorch, a folder ``vlfit export`` wrote on the runtime of its format, or a preset), for
``vlfit.inference.runtime.ModelRuntime``: every door embeds through a runtime.
"""

from __future__ import annotations

import dataclasses
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
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.inference.towers import IMAGE_INPUT, PATCH_INPUTS, TEXT_INPUTS, ImageTower, TextTower
from vlfit.models.family import InputSpec
from vlfit.models.reference import ModelReference

if TYPE_CHECKING:
    from torch import nn

    from vlfit.models.loading import LoadedModel

# What a model folder can be (a preset is not a folder: a runtime opens one too).
FOLDER_KINDS = ("checkpoint", "adapters", "export")


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
    def encode_images(
        self,
        pixels: torch.Tensor | np.ndarray,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """uint8 pixels ``[B, 3, H, W]`` -> float32 ``[B, D]``; a NaFlex model's: uint8 patches ``[B, N, p * p * 3]``
        with their ``pixel_attention_mask`` ``[B, N]`` and ``spatial_shapes`` ``[B, 2]`` (``vlfit.data.naflex``)."""

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

    def check_embeds_into(self, identity: ModelIdentity, where: str) -> None:
        """Raise ``RefusedModelError`` unless this model embeds into the space ``identity`` describes (``where``
        names what holds those embeddings: ``the index INDEX``)."""
        identity.check_compatible(self.identity, what=where, other_what=f"the model {self.model_path}")


def _as_numpy_uint8(pixels: torch.Tensor | np.ndarray) -> np.ndarray:
    array = pixels.numpy() if isinstance(pixels, torch.Tensor) else pixels
    if array.dtype != np.uint8:
        raise ValueError(f"the image graphs take uint8 pixels, got {array.dtype}")
    return np.ascontiguousarray(array)


def _image_feeds(
    pixels: torch.Tensor | np.ndarray, pixel_attention_mask: torch.Tensor | None, spatial_shapes: torch.Tensor | None
) -> dict[str, np.ndarray]:
    """The image graph's inputs: uint8 pixels, and a NaFlex graph's int64 patch mask and grids."""
    feeds = {IMAGE_INPUT: _as_numpy_uint8(pixels)}
    if pixel_attention_mask is not None and spatial_shapes is not None:
        feeds[PATCH_INPUTS[0]] = pixel_attention_mask.numpy().astype(np.int64)
        feeds[PATCH_INPUTS[1]] = spatial_shapes.numpy().astype(np.int64)
    return feeds


def _text_feeds(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, np.ndarray]:
    ids_name, mask_name = TEXT_INPUTS
    return {ids_name: input_ids.numpy().astype(np.int64), mask_name: attention_mask.numpy().astype(np.int64)}


class TorchEncoder(Encoder):
    """A loaded model on PyTorch (fp32, eval mode), through the family's towers (``build_encoder`` makes one).

    Args:
        loaded: The model with its spec (put in eval mode and fp32 here; its towers use it, not a copy: changes to
            its weights show).
        model_path: What the model is called (its folder, or ``preset:NAME`` for a preset's random weights).
        fingerprint: What identifies its weights (``checkpoint_fingerprint`` of a folder).

    Attributes:
        loaded: The model with its spec.
        image_tower: uint8 pixels -> embeddings (what ``vlfit export`` traces).
        text_tower: Token ids and mask -> embeddings.
    """

    backend = "torch"
    precision = "fp32"

    def __init__(self, loaded: LoadedModel, model_path: str, fingerprint: str) -> None:
        model = loaded.model.eval().float()
        self.loaded = loaded
        self.model_path = model_path
        self.spec = loaded.inputs
        self.image_tower = ImageTower(loaded.family, model, loaded.inputs).eval()
        self.text_tower = TextTower(loaded.family, model).eval()
        with torch.inference_mode():
            probe = self.text_tower(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
        self.identity = ModelIdentity(loaded.family.name, int(probe.shape[-1]), fingerprint)

    @property
    def model(self) -> nn.Module:
        """The model the towers run."""
        return self.loaded.model

    def save(self, folder: str) -> None:
        """Save the model with its tokenizer and image processor into ``folder`` (``LoadedModel.save``)."""
        self.loaded.save(folder)

    @torch.inference_mode()
    def encode_images(
        self,
        pixels: torch.Tensor | np.ndarray,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tensor = torch.from_numpy(pixels) if isinstance(pixels, np.ndarray) else pixels
        return self.image_tower(tensor, pixel_attention_mask, spatial_shapes).float()

    @torch.inference_mode()
    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text_tower(input_ids, attention_mask).float()


class _ExportedEncoder(Encoder):
    def __init__(self, exported: ExportFolder, precision: str, max_seq_length: int | None = None) -> None:
        if precision == "auto":
            precision = "int8" if "int8" in exported.precisions else "fp32"
        self.precision = precision
        self.model_path = exported.path
        self.exported = exported
        self.spec = exported.input_spec(max_seq_length)
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
        max_seq_length: Caption length (``None``: the export's, which is the run's).
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
        max_seq_length: int | None = None,
    ) -> None:
        require_extra("export", "the onnxruntime backend", ("onnxruntime",))  # before the folder is read
        super().__init__(exported, precision, max_seq_length)
        self.sessions = {
            tower: onnx_session(exported.graph_path(tower, self.precision), num_threads, allow_spinning)
            for tower in ("image", "text")
        }

    def encode_images(
        self,
        pixels: torch.Tensor | np.ndarray,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        (out,) = self.sessions["image"].run(None, _image_feeds(pixels, pixel_attention_mask, spatial_shapes))
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
        max_seq_length: Caption length (``None``: the export's, which is the run's).
    """

    backend = "openvino"

    def __init__(
        self,
        exported: ExportFolder,
        precision: str = "auto",
        inference_precision: str | None = None,
        num_threads: int | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        require_extra("export", "the openvino backend", ("openvino",))  # before the folder is read
        super().__init__(exported, precision, max_seq_length)
        self.compiled = {
            tower: openvino_model(exported.graph_path(tower, self.precision), inference_precision, num_threads)
            for tower in ("image", "text")
        }

    def encode_images(
        self,
        pixels: torch.Tensor | np.ndarray,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        compiled = self.compiled["image"]
        feeds = _image_feeds(pixels, pixel_attention_mask, spatial_shapes)
        return torch.from_numpy(np.asarray(compiled(feeds)[compiled.output(0)]))

    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        compiled = self.compiled["text"]
        feeds = _text_feeds(input_ids, attention_mask)
        return torch.from_numpy(np.asarray(compiled(feeds)[compiled.output(0)])).float()


def build_encoder(reference: ModelReference, settings: RuntimeSettings) -> Encoder:
    """The encoder of a checkpoint folder, an export folder or a preset, on ``settings``: what
    ``vlfit.inference.runtime.ModelRuntime.encoder`` builds (every door gets its encoder from a runtime).

    Raises:
        ConfigError: for a preset on another runtime than torch.
        RefusedModelError: for a combination that cannot run (a checkpoint on ONNX Runtime, an ONNX export on
            OpenVINO...), a missing tokenizer, graphs older than their checkpoint, a precision not exported, or a
            question-answering model.
    """
    backend, precision = settings.backend, settings.precision
    if reference.kind == "preset":
        if backend not in ("auto", "torch"):
            raise ConfigError(
                f"preset {reference.path} runs on torch; export a trained checkpoint for --backend {backend!r}"
            )
        return _preset_encoder(reference.path, settings.max_seq_length, settings.max_num_patches)
    other = "onnx" if backend == "onnxruntime" else "openvino"
    if reference.kind != "export":
        if backend not in ("auto", "torch"):
            raise RefusedModelError(
                f"{reference.path} is a checkpoint, which runs on torch; for --backend {backend} export it first "
                f"with vlfit export --model_name_or_path {reference.path} --format {other}"
            )
        if precision == "int8":
            raise RefusedModelError(f"{reference.path}: INT8 runs on exported graphs only; export with --quantize int8")
        return _torch_encoder(reference, settings.max_seq_length, settings.max_num_patches)
    exported = ExportFolder.open(reference.path, check_source=False)
    exported.check_backend(backend)
    exported.check_source_unchanged()
    exported.check_caption_length(settings.max_seq_length)
    encoder: _ExportedEncoder
    if exported.runtime == "onnxruntime":
        encoder = OnnxRuntimeEncoder(
            exported,
            precision,
            num_threads=settings.num_threads,
            allow_spinning=settings.allow_spinning,
            max_seq_length=settings.max_seq_length,
        )
    else:
        encoder = OpenVinoEncoder(
            exported,
            precision,
            inference_precision=settings.inference_precision,
            num_threads=settings.num_threads,
            max_seq_length=settings.max_seq_length,
        )
    if settings.max_num_patches is not None:
        encoder.spec = _exported_patch_budget(encoder.spec, settings.max_num_patches, exported.path)
    return encoder


def _exported_patch_budget(spec: InputSpec, asked: int, path: str) -> InputSpec:
    """``spec`` at the token budget ``asked``, within the patch count the graphs were exported for.

    Raises:
        ConfigError: for a budget asked of a model of square images.
        RefusedModelError: for one above the export's.
    """
    exported = spec.max_num_patches
    if exported is None:
        raise ConfigError(
            f"--max_num_patches is for NaFlex models (SigLIP 2); {path} takes square images: leave the flag out"
        )
    if asked > exported:
        raise RefusedModelError(
            f"{path}: --max_num_patches {asked} is more than the {exported} patches its image graph takes; ask for at "
            "most that, or export again from a run trained (or loaded) with more"
        )
    return dataclasses.replace(spec, max_num_patches=asked)


def _torch_encoder(
    reference: ModelReference, max_seq_length: int | None, max_num_patches: int | None = None
) -> TorchEncoder:
    """A checkpoint folder on PyTorch: fp32, eval mode, the sdpa attention path, at the run's caption length (or
    ``max_seq_length``)."""
    from vlfit.models.loading import load_model  # only here: it imports transformers' models

    folder = reference.path
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise RefusedModelError(
            f"{folder}: the checkpoint has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save one beside the weights "
            "(vlfit train does)"
        )
    loaded = load_model(model_name_or_path=reference, max_seq_length=max_seq_length, max_num_patches=max_num_patches)
    return TorchEncoder(loaded, folder, checkpoint_fingerprint(folder))


def _preset_encoder(preset: str, max_seq_length: int | None, max_num_patches: int | None = None) -> TorchEncoder:
    from vlfit.data.synthetic.scenes import scene_and_choices
    from vlfit.models.loading import load_model

    rng = np.random.default_rng(0)
    captions = [caption for _ in range(64) for caption in scene_and_choices(rng)[1]]
    loaded = load_model(
        model_preset=preset, captions=lambda: captions, max_seq_length=max_seq_length, max_num_patches=max_num_patches
    )
    return TorchEncoder(loaded, f"preset:{preset}", f"preset:{preset}")
