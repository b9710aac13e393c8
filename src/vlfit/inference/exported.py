"""An exported model folder as ``vlfit export`` writes it, and the checks made before it is used.

Layout::

    export_manifest.json      family, embedding size, inputs, opset, library versions, source checkpoint hash,
                              the parity and accuracy figures measured at export
    image.onnx, text.onnx     (or image.xml/.bin, text.xml/.bin for OpenVINO) fp32 graphs
    image.int8.onnx, ...      INT8 graphs, with --quantize int8
    itm.onnx, itm.int8.onnx   ONNX only, for a model with an image-text matching head: captions, images and pair
                              rows -> matching log-odds (vlfit.inference.export_itm, vlfit.inference.pair_scorer)
    tokenizer.json, ...       the tokenizer (saved by transformers)

A folder whose tokenizer is missing, or whose source checkpoint changed after the export, is refused with one line
(``RefusedModelError``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlfit.errors import MissingFileError
from vlfit.inference.identity import ModelIdentity, RefusedModelError, checkpoint_fingerprint, weights_mtime
from vlfit.models.family import InputSpec
from vlfit.models.reference import EXPORT_MANIFEST

# The runtime each export format's graphs run on.
_FORMAT_RUNTIME = {"onnx": "onnxruntime", "openvino": "openvino"}
MANIFEST_NAME = EXPORT_MANIFEST  # what tells an export folder apart (vlfit.models.reference)
FORMATS = ("onnx", "openvino")
PRECISIONS = ("fp32", "int8")
TOWERS = ("image", "text")
_EXTENSION = {"onnx": ".onnx", "openvino": ".xml"}
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


class ExportParityError(RefusedModelError):
    """An exported graph's outputs differ from PyTorch's by more than the parity check allows."""


def check_parity(cosines: Mapping[str, Mapping[str, float]], threshold: float, samples: int, what: str) -> None:
    """Refuse an export whose embeddings of a tower fall below ``threshold`` cosine to PyTorch's.

    Args:
        cosines: Per tower, its ``cosine_figures`` (``min_cosine`` read).
        threshold: The lowest cosine allowed (``--parity_threshold``).
        samples: How many samples were embedded, for the message.
        what: Whose embeddings, with ``{tower}``: ``the exported fp32 {tower} graph's``.

    Raises:
        ExportParityError: naming the tower, its cosine and the threshold.
    """
    for tower, figures in cosines.items():
        worst = figures["min_cosine"]
        if worst < threshold:
            raise ExportParityError(
                f"{what.format(tower=tower)} embeddings differ from PyTorch's: cosine {worst:.6f} on {samples} "
                f"samples, below the {threshold} required; nothing was written"
            )


def graph_name(tower: str, precision: str, fmt: str) -> str:
    """File name of one graph: ``image.onnx``, ``text.int8.xml`` ..."""
    return tower + ("" if precision == "fp32" else f".{precision}") + _EXTENSION[fmt]


@dataclass
class ExportFolder:
    """A folder ``vlfit export`` wrote, and its manifest.

    Attributes:
        path: The folder.
        manifest: The parsed ``export_manifest.json``.
    """

    path: str
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str, *, check_source: bool = True) -> ExportFolder:
        """Read the manifest and refuse a folder that cannot be used.

        Args:
            path: The folder.
            check_source: Refuse the graphs when their source checkpoint still exists and its weights changed
                after the export.

        Raises:
            FileNotFoundError: when the folder has no manifest.
            RefusedModelError: when the tokenizer is missing or the graphs are older than their checkpoint.
        """
        manifest_path = os.path.join(path, MANIFEST_NAME)
        if not os.path.isfile(manifest_path):
            raise MissingFileError(f"{path}: no {MANIFEST_NAME}; pass a folder that vlfit export wrote")
        with open(manifest_path, encoding="utf-8") as f:
            exported = cls(path, json.load(f))
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise RefusedModelError(
                f"{path}: the exported model has no tokenizer ({' or '.join(TOKENIZER_FILES)}) beside its graphs; "
                "export it again with vlfit export"
            )
        if check_source:
            exported.check_source_unchanged()
        return exported

    @property
    def format(self) -> str:
        return str(self.manifest["format"])

    @property
    def runtime(self) -> str:
        """The runtime the folder's graphs run on: ``onnxruntime`` (format ``onnx``) or ``openvino``."""
        return _FORMAT_RUNTIME[self.format]

    def check_backend(self, backend: str) -> None:
        """Refuse a ``--backend`` other than ``auto`` or the folder's own runtime.

        Raises:
            RefusedModelError: naming the folder, its runtime and what to pass instead.
        """
        if backend in ("auto", self.runtime):
            return
        if backend == "torch":
            instead = "pass the checkpoint it was exported from"
        else:
            instead = f"export with --format {'onnx' if backend == 'onnxruntime' else 'openvino'}"
        raise RefusedModelError(
            f"{self.path} holds {self.format} graphs, which run on {self.runtime}, not {backend}; use --backend "
            f"{self.runtime} (or auto), or {instead}"
        )

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.from_dict(self.manifest["identity"])

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions whose two tower graphs are in the folder."""
        return tuple(p for p in PRECISIONS if all(p in self.graph_precisions(t) for t in TOWERS))

    def graph_precisions(self, graph: str) -> tuple[str, ...]:
        """The precisions graph ``graph`` (``image``, ``text``, ``itm``) is in the folder in (none: it is not)."""
        graphs = self.manifest.get("graphs", {}).get(graph, {})
        return tuple(p for p in PRECISIONS if graphs.get(p))

    def graph_path(self, tower: str, precision: str) -> str:
        """Path of one graph.

        Raises:
            RefusedModelError: when the folder has no graph of that precision.
        """
        name = self.manifest["graphs"].get(tower, {}).get(precision)
        if not name:
            has = ", ".join(self.graph_precisions(tower)) or "none"
            raise RefusedModelError(
                f"{self.path}: no {precision} {tower} graph (it has: {has}); "
                f"export with {'--quantize int8' if precision == 'int8' else 'vlfit export'} first"
            )
        return os.path.join(self.path, name)

    def check_caption_length(self, max_seq_length: int | None) -> None:
        """Refuse a caption length longer than the graphs were exported for (their sequence axis ends there).

        Raises:
            RefusedModelError: naming ``--max_seq_length`` and the longest the folder takes.
        """
        exported = int(self.manifest["text"]["max_seq_length"])
        if max_seq_length is not None and max_seq_length > exported:
            raise RefusedModelError(
                f"{self.path}: --max_seq_length {max_seq_length} is longer than the {exported} tokens its graphs take; "
                f"ask for at most {exported}, or export again with vlfit export --max_seq_length {max_seq_length}"
            )

    def input_spec(self, max_seq_length: int | None = None) -> InputSpec:
        """Image size, mean, std and the tokenizer saved beside the graphs, at the caption length of the export (the
        run's) or ``max_seq_length`` (checked by ``check_caption_length``)."""
        from transformers import AutoTokenizer  # only here: a manifest is read without transformers

        image = self.manifest["image"]
        return InputSpec(
            image_size=int(image["size"]),
            image_mean=tuple(float(x) for x in image["mean"]),  # type: ignore[arg-type]
            image_std=tuple(float(x) for x in image["std"]),  # type: ignore[arg-type]
            tokenizer=AutoTokenizer.from_pretrained(self.path),
            max_seq_length=max_seq_length or int(self.manifest["text"]["max_seq_length"]),
            # A NaFlex model's token budget and patch size: the run's, as the graphs were exported at.
            max_num_patches=image.get("max_num_patches"),
            patch_size=image.get("patch_size"),
        )

    def check_source_unchanged(self) -> None:
        """Refuse graphs older than their checkpoint: its weights were written after the export and differ.

        A checkpoint that no longer exists (the export was copied elsewhere) is not checked. The weights are
        hashed only when their files are newer than the export.
        """
        source = self.manifest["source"]
        checkpoint = source.get("path")
        if not checkpoint or not os.path.isdir(checkpoint):
            return
        if weights_mtime(checkpoint) <= float(source["exported_at"]):
            return
        try:
            current = checkpoint_fingerprint(checkpoint)
        except FileNotFoundError:
            return
        if current != self.identity.checkpoint_sha256:
            raise RefusedModelError(
                f"{self.path}: the exported graphs are older than their checkpoint {checkpoint} (its weights changed "
                f"after the export: {self.identity.checkpoint_sha256[:12]} then, {current[:12]} now); run vlfit "
                "export again"
            )
