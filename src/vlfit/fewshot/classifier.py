"""A saved image classifier: a checkpoint and a linear head over its image embeddings.

Layout::

    classifier.json      the method, its shots and seed, the class names, the label column, the head's choice
                         and the accuracy it had on the evaluation split
    head.safetensors     weight [C, D] and bias [C]
    model/               the checkpoint (SetFit's: the fine-tuned image tower); any vlfit command and plain
                         transformers load it; its README.md is its model card

The folder is written beside its final place and renamed into it, so a reader sees a whole classifier or none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlfit.data.batch import Batch
from vlfit.data.image_inputs import ImageBatch, encoder_inputs
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import MissingFileError
from vlfit.fewshot.heads import LinearHead
from vlfit.inference.backends import Encoder
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.model_card import write_model_card

CLASSIFIER_FILE = "classifier.json"
HEAD_FILE = "head.safetensors"
MODEL_FOLDER = "model"


@dataclass
class ClassifierInfo:
    """What ``classifier.json`` holds."""

    method: str
    class_names: list[str]
    label_column: str
    shots: int
    seed: int
    head: str
    accuracy: float
    templates: list[str]
    source_model: str

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": 1, **self.__dict__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClassifierInfo:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


def write_classifier_card(
    model_folder: str, info: ClassifierInfo, *, dataset: str | None = None, command_line: str | None = None
) -> str:
    """The model card of a classifier's checkpoint (``vlfit.model_card``); returns its path.

    Args:
        model_folder: The classifier's ``model/`` folder, written already.
        info: What the classifier is.
        dataset: The labelled dataset its shots came from.
        command_line: The ``vlfit fewshot`` command that made it.
    """
    from transformers import AutoConfig

    from vlfit.models.registry import family_for_config

    family = family_for_config(AutoConfig.from_pretrained(model_folder))
    tower = (
        f"its image tower was tuned with SetFit's recipe on {info.shots} labelled images per class (seed {info.seed})"
        if info.method == "setfit"
        else "its weights are the source model's"
    )
    how_made = (
        f"It is the checkpoint of a few-shot image classifier (`vlfit fewshot`, method {info.method}): {tower}. "
        f"The classifier's linear head ({info.head}, {len(info.class_names)} classes of the `{info.label_column}` "
        f"column: {', '.join(info.class_names)}) is `{HEAD_FILE}` beside this folder; `vlfit classify` applies both."
    )
    metrics = {"eval_accuracy": info.accuracy, "shots_per_class": info.shots, "seed": info.seed}
    return write_model_card(
        model_folder,
        family_name=family.name,
        base_model=info.source_model,
        preset=None,
        datasets=[dataset] if dataset else [],
        metrics=metrics,
        command_line=command_line,
        how_made=how_made,
        fine_tuned=info.method == "setfit",  # other methods train only the head: the weights are the source's
    )


def save_classifier(
    folder: str,
    save_model: Any,
    head: LinearHead,
    info: ClassifierInfo,
    *,
    dataset: str | None = None,
    command_line: str | None = None,
) -> None:
    """Write a classifier folder (replacing one already there), its checkpoint with a model card.

    Args:
        folder: The classifier folder.
        save_model: Writes the checkpoint into the folder it is given (``TorchEncoder.save``).
        head: The linear head.
        info: What the classifier is.
        dataset: The labelled dataset (named in the model card).
        command_line: The command that made the classifier (quoted in the model card).
    """
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(os.path.abspath(folder))}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        os.makedirs(staging)
        save_model(os.path.join(staging, MODEL_FOLDER))
        write_classifier_card(os.path.join(staging, MODEL_FOLDER), info, dataset=dataset, command_line=command_line)
        save_file(
            {"weight": head.weight.contiguous(), "bias": head.bias.contiguous()}, os.path.join(staging, HEAD_FILE)
        )
        with open(os.path.join(staging, CLASSIFIER_FILE), "w", encoding="utf-8") as f:
            json.dump(info.to_dict(), f, indent=1)
            f.write("\n")
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass
class Prediction:
    """One image's class: its label, the label's probability, and every class's."""

    id: str
    label: str
    probability: float
    probabilities: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "label": self.label,
            "probability": self.probability,
            "probabilities": self.probabilities,
        }


class Classifier:
    """A classifier folder, loaded.

    Args:
        folder: What ``save_classifier`` wrote (``vlfit fewshot --save_classifier``).
        settings: How its model runs (``None``: the defaults); the backend is always PyTorch.

    Raises:
        FileNotFoundError: when the folder is not a classifier.
    """

    def __init__(self, folder: str, settings: RuntimeSettings | None = None) -> None:
        info_path = os.path.join(folder, CLASSIFIER_FILE)
        if not os.path.isfile(info_path):
            raise MissingFileError(
                f"--model {folder}: no {CLASSIFIER_FILE}; save a classifier with vlfit fewshot --save_classifier DIR"
            )
        from safetensors.torch import load_file

        with open(info_path, encoding="utf-8") as f:
            self.info = ClassifierInfo.from_dict(json.load(f))
        tensors = load_file(os.path.join(folder, HEAD_FILE))
        self.head = LinearHead(tensors["weight"], tensors["bias"])
        torch_settings = dataclasses.replace(settings or RuntimeSettings(), backend="torch")
        self.encoder: Encoder = ModelRuntime.open(os.path.join(folder, MODEL_FOLDER), torch_settings).encoder
        self.folder = folder

    @property
    def class_names(self) -> list[str]:
        return self.info.class_names

    def image_batches(
        self, source: ImageTextSource, *, batch_size: int = 32, num_workers: int = 0
    ) -> Iterator[tuple[Batch, ImageBatch | None]]:
        """The host batches of ``source`` through the model's image path, in order, each with its images' batch
        (None for a batch left without rows); the images that do not decode are in each batch's ``bad_samples``."""
        for batch in host_batches(source, self.encoder.spec, batch_size=batch_size, num_workers=num_workers):
            yield batch, encoder_inputs(batch.inputs) if len(batch) else None

    def embed(self, images: ImageBatch) -> torch.Tensor:
        """The image embeddings ``float32 [B, D]`` of a batch (``vlfit.data.image_inputs``: uint8 pixels, or a NaFlex
        model's patches with their mask and grids)."""
        return self.encoder.encode_images(**images)

    def probabilities(self, images: ImageBatch) -> torch.Tensor:
        """``float32 [B, C]`` for a batch of images."""
        return self.head.probabilities(self.embed(images))

    def predict(self, images: ImageBatch, ids: Sequence[str]) -> list[Prediction]:
        probabilities = self.probabilities(images)
        predictions = []
        for sample_id, row in zip(ids, probabilities.tolist(), strict=True):
            best = max(range(len(row)), key=row.__getitem__)
            by_name = dict(zip(self.class_names, row, strict=True))
            predictions.append(Prediction(sample_id, self.class_names[best], row[best], by_name))
        return predictions
