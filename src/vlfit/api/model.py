"""``vlfit.load`` and the ``Model`` it returns: embed images and texts, score them, answer questions."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from vlfit.data.image_inputs import ImageInput
from vlfit.data.text_checks import unicode_problem
from vlfit.errors import ConfigError, DataError, python_api
from vlfit.inference.backends import Encoder
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings


class Model:
    """A model ready to embed: a checkpoint (PyTorch) or a folder ``vlfit export`` wrote (ONNX Runtime, OpenVINO);
    or, for a folder ``vlfit train --task vqa`` wrote, ready to answer questions (``answer``), with nothing to embed
    with. Every call runs through one ``vlfit.inference.runtime.ModelRuntime``: the caption length and image
    settings the run was trained with, one thread setting.

    Args:
        runtime: The model's runtime (``load`` opens it).
    """

    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime

    @property
    def encoder(self) -> Encoder:
        """The backend's encoder.

        Raises:
            RefusedModelError: for a question-answering model, which has no contrastive heads to embed with.
        """
        return self.runtime.encoder

    @property
    def backend(self) -> str:
        """``torch``, ``onnxruntime`` or ``openvino``."""
        return "torch" if self.runtime.answers_questions else self.encoder.backend

    @property
    def image_size(self) -> int:
        """The side of the square images the model takes (a NaFlex model's images are not square: see
        ``max_num_patches``)."""
        return self.runtime.image_size

    @property
    def max_num_patches(self) -> int | None:
        """A NaFlex model's (SigLIP 2) patch budget: each image is cut into at most this many patches, keeping its
        aspect ratio; the run's, unless ``load`` was given another. None for a model of square images."""
        return self.runtime.inputs.max_num_patches

    @property
    def max_seq_length(self) -> int:
        """Captions (questions) are cut at this many tokens: the run's, unless ``load`` was given another."""
        return self.runtime.inputs.max_seq_length

    @property
    def rerank_weight(self) -> float | None:
        """The cosine's weight beside the matching log-odds that re-ranking uses by default (``--rerank_score
        itm+itc``), as the run saved it (``rerank.json``); None without one (re-ranking by ITM alone)."""
        return self.runtime.saved_rerank_weight

    @property
    def embedding_dim(self) -> int:
        """Length of an embedding (``load``'s ``embedding_dim`` when given)."""
        return self.encoder.identity.embedding_size

    def __repr__(self) -> str:
        return f"vlfit.{self.runtime!r}".replace("ModelRuntime(", "Model(", 1)

    @python_api
    def encode_images(self, images: ImageInput | Iterable[ImageInput], batch_size: int = 32) -> np.ndarray:
        """L2-normalized float32 embeddings ``[N, D]`` of images: paths, encoded bytes, PIL images or uint8 arrays
        (``[H, W(, C)]``, or one ``[N, H, W, C]`` batch).

        Images go through the fast CPU pipeline (DCT-scaled decode, center crop, bicubic resize on uint8), as in
        training and evaluation. A single image (not in a list) gives ``[1, D]``.

        Raises:
            MissingFileError: for a path that does not exist.
            DataError: for an image that cannot be decoded or an input of another kind (naming its position).
            ArgumentError: for ``images`` that is neither an image nor an iterable of them, a bad ``batch_size``.
        """
        check_at_least("batch_size", batch_size, 1)
        return _as_numpy(self.runtime.embed_images(images, batch_size))

    @python_api
    def encode_texts(self, texts: str | Sequence[str], batch_size: int = 256) -> np.ndarray:
        """L2-normalized float32 embeddings ``[N, D]`` of captions, tokenized as training tokenized them."""
        check_at_least("batch_size", batch_size, 1)
        return _as_numpy(self.runtime.embed_texts(text_list("texts", texts), batch_size))

    @python_api
    def similarity(self, images: ImageInput | Iterable[ImageInput], texts: str | Sequence[str]) -> np.ndarray:
        """Cosine similarities ``[num_images, num_texts]`` (the model's temperature is not applied)."""
        return self.encode_images(images) @ self.encode_texts(texts).T

    @python_api
    def answer(
        self,
        images: ImageInput | Iterable[ImageInput],
        questions: str | Sequence[str],
        top_k: int = 3,
        batch_size: int = 32,
    ) -> list[list[tuple[str, float]]]:
        """The ``top_k`` best answers to each question, best first, as ``(answer, score)`` pairs (score: the
        sigmoid of the answer's logit), from a model ``vlfit train --task vqa`` saved (PyTorch backend),
        ``batch_size`` questions to a forward.

        One image per question, or one image for every question (images as ``encode_images`` takes them).

        Raises:
            ConfigError: for a model without a VQA head.
            DataError: for as many images as questions but not one image per question, or a bad image.
        """
        check_at_least("top_k", top_k, 1)
        check_at_least("batch_size", batch_size, 1)
        answers = self.runtime.answer(images, text_list("questions", questions), top_k, batch_size)
        return [[(a.answer, a.score) for a in row] for row in answers]


def check_at_least(keyword: str, value: int | float, least: int | float) -> None:
    """Refuse ``value`` below ``least`` in one line naming ``keyword`` (worded as the flag; ``python_api`` rewords
    it as the keyword)."""
    if value < least:
        raise ConfigError(f"--{keyword} must be at least {least}, got {value}")


def text_list(keyword: str, texts: str | Sequence[str]) -> list[str]:
    """``texts`` as a list of strings (a string alone: a list of one).

    Raises:
        DataError: naming ``keyword[position]`` for an item that is not a string, or not valid Unicode text.
    """
    items = [texts] if isinstance(texts, str) else list(texts)
    for position, text in enumerate(items):
        if not isinstance(text, str):
            raise DataError(f"{keyword}[{position}]: expected a string, got {type(text).__name__}")
        if problem := unicode_problem(text, f"{keyword}[{position}]"):
            raise DataError(problem)
    return items


def _as_numpy(embeddings: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(embeddings.numpy(), dtype=np.float32)


@python_api(renames={"model": "path_or_preset", "model_name_or_path": "path_or_preset"})
def load(
    path_or_preset: str | os.PathLike,
    backend: str = "auto",
    *,
    precision: str = "auto",
    num_threads: int | None = None,
    max_seq_length: int | None = None,
    allow_spinning: bool = True,
    max_num_patches: int | None = None,
    embedding_dim: int | None = None,
) -> Model:
    """Load a model to embed with (or, for a VQA run, to answer questions with).

    Args:
        path_or_preset: A checkpoint folder (``vlfit train``'s output, LoRA adapters included), a folder
            ``vlfit export`` wrote, or a preset name (random weights, with a byte-level tokenizer trained on
            ``vlfit make-data``'s caption grammar: for trying the API, not for results).
        backend: ``auto`` (the folder's own runtime: PyTorch for a checkpoint, the exported format's runtime),
            ``torch``, ``onnxruntime`` or ``openvino``.
        precision: Exported graphs: ``auto`` (INT8 when exported), ``fp32`` or ``int8``.
        num_threads: Threads of the runtime (``None``: its default).
        max_seq_length: Cut captions at this many tokens (``None``: the length the run was trained with, from
            its ``input_spec.json``; another is logged).
        allow_spinning: ONNX Runtime's idle threads spin-wait for the next call (its default; a server that shares
            its cores with an event loop turns it off).
        max_num_patches: A NaFlex model's (SigLIP 2) token budget per image (``None``: the budget the run was
            trained with, from its ``input_spec.json``; another is logged; an export takes at most its own).
        embedding_dim: Keep the first this many dimensions of every embedding, L2-normalized again (``None``: all of
            them): a Matryoshka run's trained sizes (its ``input_spec.json``'s ``matryoshka_dims``), or another,
            logged; more than the model's is refused.
    """
    settings = RuntimeSettings(backend=backend, precision=precision, num_threads=num_threads,
                               max_seq_length=max_seq_length, allow_spinning=allow_spinning,
                               max_num_patches=max_num_patches, embedding_dim=embedding_dim)  # fmt: skip
    runtime = ModelRuntime.open(path_or_preset, settings)
    runtime.answerer if runtime.answers_questions else runtime.encoder  # noqa: B018  (a bad folder fails here)
    return Model(runtime)
