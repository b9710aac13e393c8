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
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vlfit.errors import ConfigError
from vlfit.inference.embedding_dim import checked_size, cut, trained_sizes
from vlfit.inference.exported import TOKENIZER_FILES, TOWERS, ExportFolder
from vlfit.inference.graph_runtimes import GraphRuntime, graph_runtime, openvino_hint
from vlfit.inference.identity import ModelIdentity, RefusedModelError, checkpoint_fingerprint
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.inference.towers import IMAGE_INPUT, PATCH_INPUTS, TEXT_INPUTS, ImageTower, TextTower
from vlfit.models.family import InputSpec
from vlfit.models.input_spec_file import read_input_settings
from vlfit.models.reference import ModelReference
from vlfit.threads import on_own_threads

if TYPE_CHECKING:
    from torch import nn

    from vlfit.models.loading import LoadedModel

# What a model folder can be (a preset is not a folder: a runtime opens one too).
FOLDER_KINDS = ("checkpoint", "adapters", "export")


class ModelPart:
    """What every part of a runtime that runs a model (an encoder, a pair scorer) says of itself.

    Attributes:
        backend: ``torch``, ``onnxruntime`` or ``openvino``.
        precision: ``fp32`` or ``int8`` (PyTorch: ``fp32``).
        model_path: The checkpoint or export folder.
        spec: Image size, mean, std, tokenizer and caption length.
    """

    backend: str
    precision: str
    model_path: str
    spec: InputSpec
    kind = ""  # what ``description`` calls the part before its path

    @property
    def description(self) -> str:
        return f"{self.kind}{self.model_path} on {self.backend} ({self.precision})"


class Encoder(ModelPart, ABC):
    """Embeds uint8 images and tokenized captions (the attributes of ``ModelPart``, and ``identity``: what the
    embeddings are comparable with; ``embedding_dim``: the size they are cut to, ``None`` for the model's own)."""

    identity: ModelIdentity
    embedding_dim: int | None = None

    def keep_dimensions(self, size: int | None, record: Mapping[str, Any] | None = None) -> None:
        """Cut every embedding to its first ``size`` dimensions, L2-normalized again (``vlfit.inference.embedding_dim``;
        ``record``: the run's input settings, which name the sizes it was trained for).

        Raises:
            RefusedModelError: for a size larger than the model's embeddings.
        """
        kept = checked_size(size, self.identity.embedding_size, trained_sizes(record), self.model_path)
        if kept is not None:
            self.embedding_dim = kept
            self.identity = dataclasses.replace(self.identity, embedding_size=kept)

    def encode_images(
        self,
        pixels: torch.Tensor | np.ndarray,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """uint8 pixels ``[B, 3, H, W]`` -> float32 ``[B, D]``; a NaFlex model's: uint8 patches ``[B, N, p * p * 3]``
        with their ``pixel_attention_mask`` ``[B, N]`` and ``spatial_shapes`` ``[B, 2]`` (``vlfit.data.naflex``)."""
        inputs: dict[str, torch.Tensor | np.ndarray] = {IMAGE_INPUT: pixels}
        if pixel_attention_mask is not None and spatial_shapes is not None:
            inputs.update(zip(PATCH_INPUTS, (pixel_attention_mask, spatial_shapes), strict=True))
        return cut(self.run_tower("image", inputs), self.embedding_dim)

    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, S]`` twice -> float32 ``[B, D]``."""
        return cut(
            self.run_tower("text", dict(zip(TEXT_INPUTS, (input_ids, attention_mask), strict=True))), self.embedding_dim
        )

    @abstractmethod
    def run_tower(self, tower: str, inputs: dict[str, torch.Tensor | np.ndarray]) -> torch.Tensor:
        """Tower ``image`` or ``text`` on its inputs by name (``vlfit.inference.towers``: ``IMAGE_INPUT`` and a
        NaFlex model's ``PATCH_INPUTS``; ``TEXT_INPUTS``) -> float32 ``[B, D]``."""

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask of ``texts``, truncated and padded as the collator does."""
        return self.spec.tokenize(texts)

    def encode_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """Caption strings -> float32 ``[len(texts), D]``."""
        tokens = self.tokenize(texts)
        return self.encode_tokens(tokens["input_ids"], tokens["attention_mask"])

    def check_embeds_into(self, identity: ModelIdentity, where: str) -> None:
        """Raise ``RefusedModelError`` unless this model embeds into the space ``identity`` describes (``where``
        names what holds those embeddings: ``the index INDEX``)."""
        identity.check_compatible(self.identity, what=where, other_what=f"the model {self.model_path}")


def graph_feeds(inputs: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
    """A graph's inputs as its runtime takes them, contiguous: uint8 pixels (``IMAGE_INPUT``), every other input
    int64 (token ids, masks, patch grids, pair rows).

    Raises:
        ValueError: for pixels of another dtype.
    """
    feeds = {}
    for name, value in inputs.items():
        array = value.numpy() if isinstance(value, torch.Tensor) else value
        if name != IMAGE_INPUT:
            array = array.astype(np.int64, copy=False)
        elif array.dtype != np.uint8:
            raise ValueError(f"the image graphs take uint8 pixels, got {array.dtype}")
        feeds[name] = np.ascontiguousarray(array)
    return feeds


class TorchEncoder(Encoder):
    """A loaded model on PyTorch (fp32, eval mode), through the family's towers (``build_encoder`` makes one).

    Args:
        loaded: The model with its spec (put in eval mode and fp32 here; its towers use it, not a copy: changes to
            its weights show).
        model_path: What the model is called (its folder, or ``preset:NAME`` for a preset's random weights).
        fingerprint: What identifies its weights (``checkpoint_fingerprint`` of a folder).
        num_threads: Torch intra-op threads of each call (``None``: the process's), set for the call and put back
            after it (``vlfit.threads.torch_threads``): a runtime's threads are its own, not the process's.

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
        self.num_threads = num_threads
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

    @on_own_threads
    @torch.inference_mode()
    def run_tower(self, tower: str, inputs: dict[str, torch.Tensor | np.ndarray]) -> torch.Tensor:
        module = self.image_tower if tower == "image" else self.text_tower
        values = [torch.from_numpy(value) if isinstance(value, np.ndarray) else value for value in inputs.values()]
        return module(*values).float()


# ------------------------------------------------------------------------------------------ exported graphs


def exported_precision(asked: str, exported: Sequence[str]) -> str:
    """The precision of a part whose graphs were ``exported`` in those precisions: ``asked``, or for ``auto``
    INT8 when exported, else fp32."""
    if asked != "auto":
        return asked
    return "int8" if "int8" in exported else "fp32"


class ExportedPart(ModelPart):
    """Graphs of an export folder at one precision, open on the runtime of its format: what an exported encoder
    and an exported pair scorer share.

    Args:
        exported: The export folder.
        runtime: Where its graphs run (``graph_runtime``).
        graphs: The graphs' names in the folder's manifest.
        precision: ``fp32`` or ``int8``.
        max_seq_length: Caption length (``None``: the export's, which is the run's).

    Attributes:
        exported: The export folder.
        runtime: Where its graphs run.
        graphs: The open graphs by name (ONNX Runtime sessions, OpenVINO compiled models).

    Raises:
        RefusedModelError: when the folder has no graph of ``precision``.
    """

    def __init__(
        self, exported: ExportFolder, runtime: GraphRuntime, graphs: Sequence[str], precision: str,
        max_seq_length: int | None = None,
    ) -> None:  # fmt: skip
        self.backend = runtime.backend
        self.precision = precision
        self.model_path = exported.path
        self.exported = exported
        self.runtime = runtime
        self.spec = exported.input_spec(max_seq_length)
        graph = "fp32" if precision == "bf16" else precision  # bf16: the fp32 graphs at OpenVINO's bf16 hint
        self.graphs = {name: runtime.open(exported.graph_path(name, graph)) for name in graphs}

    def run_graph(self, name: str, inputs: Mapping[str, torch.Tensor | np.ndarray]) -> torch.Tensor:
        """Graph ``name`` on its ``inputs`` by name -> its float32 output."""
        out = self.runtime.run(self.graphs[name], graph_feeds(inputs))
        return torch.from_numpy(np.asarray(out, dtype=np.float32))


class ExportedEncoder(ExportedPart, Encoder):
    """An export folder's image and text graphs on the runtime of its format (``build_encoder`` makes one).

    Args:
        exported: The export folder.
        runtime: Where its graphs run (``graph_runtime``).
        precision: ``fp32``, ``int8`` or ``auto`` (INT8 when exported).
        max_seq_length: Caption length (``None``: the export's, which is the run's).
    """

    def __init__(
        self, exported: ExportFolder, runtime: GraphRuntime, precision: str = "auto", max_seq_length: int | None = None
    ) -> None:
        super().__init__(exported, runtime, TOWERS, exported_precision(precision, exported.precisions), max_seq_length)
        self.identity = exported.identity

    def run_tower(self, tower: str, inputs: dict[str, torch.Tensor | np.ndarray]) -> torch.Tensor:
        return self.run_graph(tower, inputs)


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
        return _sized(_preset_encoder(reference.path, settings), settings)
    other = "onnx" if backend == "onnxruntime" else "openvino"
    if reference.kind != "export":
        if backend not in ("auto", "torch"):
            raise RefusedModelError(
                f"{reference.path} is a checkpoint, which runs on torch; for --backend {backend} export it first "
                f"with vlfit export --model_name_or_path {reference.path} --format {other}"
            )
        if precision in ("int8", "bf16"):
            what = "INT8" if precision == "int8" else "bf16"
            how = "with --quantize int8" if precision == "int8" else "with --format openvino"
            raise RefusedModelError(f"{reference.path}: {what} runs on exported graphs only; export {how}")
        return _sized(_torch_encoder(reference, settings), settings, read_input_settings(reference.path))
    exported = ExportFolder.open(reference.path, check_source=False)
    exported.check_backend(backend)
    exported.check_source_unchanged()
    exported.check_caption_length(settings.max_seq_length)
    runtime = graph_runtime(exported, settings, openvino_hint(exported, settings))
    encoder = ExportedEncoder(exported, runtime, precision, settings.max_seq_length)
    if settings.max_num_patches is not None:
        encoder.spec = _exported_patch_budget(encoder.spec, settings.max_num_patches, exported.path)
    return _sized(encoder, settings, exported.manifest.get("input_spec"))


def _sized(encoder: Encoder, settings: RuntimeSettings, record: Mapping[str, Any] | None = None) -> Encoder:
    """``encoder`` at ``settings.embedding_dim``, ``record`` the run's input settings (``Encoder.keep_dimensions``)."""
    encoder.keep_dimensions(settings.embedding_dim, record)
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


def _torch_encoder(reference: ModelReference, settings: RuntimeSettings) -> TorchEncoder:
    """A checkpoint folder on PyTorch: fp32, eval mode, the sdpa attention path, at the run's caption length (or
    ``settings.max_seq_length``), on ``settings.num_threads``."""
    from vlfit.models.loading import load_model  # only here: it imports transformers' models

    folder = reference.path
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise RefusedModelError(
            f"{folder}: the checkpoint has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save one beside the weights "
            "(vlfit train does)"
        )
    loaded = load_model(model_name_or_path=reference, max_seq_length=settings.max_seq_length,
                        max_num_patches=settings.max_num_patches)  # fmt: skip
    return TorchEncoder(loaded, folder, checkpoint_fingerprint(folder), settings.num_threads)


def _preset_encoder(preset: str, settings: RuntimeSettings) -> TorchEncoder:
    from vlfit.data.synthetic.scenes import scene_and_choices
    from vlfit.models.loading import load_model

    rng = np.random.default_rng(0)
    captions = [caption for _ in range(64) for caption in scene_and_choices(rng)[1]]
    loaded = load_model(model_preset=preset, captions=lambda: captions, max_seq_length=settings.max_seq_length,
                        max_num_patches=settings.max_num_patches)  # fmt: skip
    return TorchEncoder(loaded, f"preset:{preset}", f"preset:{preset}", settings.num_threads)
