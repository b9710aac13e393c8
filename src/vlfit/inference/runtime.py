"""``ModelRuntime``: the one way a model is run, whichever door it comes through.

``vlfit.load``, ``vlfit retrieve index`` and ``query``, ``vlfit serve``, ``vlfit export`` (its parity check),
re-ranking, ``vlfit vqa`` and ``vlfit fewshot`` open their model here, and nowhere else. A runtime holds:

- what the model is (``parse_model_reference``: a checkpoint, LoRA adapters, an export folder or a preset);
- one set of settings (``RuntimeSettings``: backend, precision, threads, caption length), checked once and applied
  to every part, so the pair scorer runs on the threads the encoder runs on;
- its input spec: the caption length and image settings the run was trained with (``input_spec.json`` beside a
  checkpoint, the manifest of an export folder), or the one ``max_seq_length`` asked for instead (logged);
- the parts the checkpoint has, each built on first use: the ``encoder`` (embeds), the ``pair_scorer`` (the
  image-text matching head, for re-ranking, by the ``rerank_score`` the run saved) and the ``answerer`` (a VQA head);
- its one image path (``image_inputs``, ``vlfit.data.image_inputs``), built once from the input spec: the batches
  every door's images become (``image_batch``: pixels, or a NaFlex model's patches with their mask and grids), and
  batching (``embed_images``, ``embed_texts``, ``answer``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from vlfit.data.image_inputs import ImageBatch, ImageInput, ImageInputs, image_list
from vlfit.errors import ConfigError, DataError
from vlfit.inference.backends import FOLDER_KINDS, Encoder, build_encoder
from vlfit.inference.identity import RefusedModelError
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.models.family import InputSpec
from vlfit.models.reference import ModelReference, parse_model_reference

if TYPE_CHECKING:
    from vlfit.inference.pair_scorer import PairScorer
    from vlfit.inference.rerank_score import RerankScore
    from vlfit.inference.vqa import Answer, QuestionAnswerer

# What a runtime opens: a preset, a checkpoint folder, LoRA adapters or an export folder.
RUNTIME_KINDS = ("preset", *FOLDER_KINDS)


class ModelRuntime:
    """A model opened once and run one way (see the module doc). Open one with ``ModelRuntime.open``.

    Args:
        reference: What the model is.
        settings: How it runs.
    """

    def __init__(self, reference: ModelReference, settings: RuntimeSettings) -> None:
        self.reference = reference
        self.settings = settings
        if reference.answers_questions:
            if settings.backend not in ("auto", "torch"):
                raise ConfigError(
                    f"{reference.path} answers questions on the torch backend, not --backend {settings.backend}"
                )
            if settings.precision == "int8":
                raise RefusedModelError(
                    f"{reference.path}: --precision int8 runs on exported graphs only, and a question-answering "
                    "model is not exported; load it with precision auto or fp32"
                )

    @classmethod
    def open(
        cls,
        model: str | os.PathLike | ModelReference,
        settings: RuntimeSettings | None = None,
        *,
        flag: str = "--model",
        kinds: Collection[str] = RUNTIME_KINDS,
    ) -> ModelRuntime:
        """The runtime of a checkpoint folder (LoRA adapters included), an export folder or a preset.

        Args:
            model: The folder or preset (``parse_model_reference`` reads it, naming ``flag`` when it is none of
                ``kinds``), or what it parsed to.
            settings: How it runs (``None``: every setting at its default: the model's own).
            flag: The option that named the model, for error messages.
            kinds: What the door takes.

        Raises:
            MissingFileError: for a path that is neither a folder nor a preset.
            RefusedModelError: for a setting the model cannot run with (INT8 of a checkpoint, a VQA model on
                another backend ...).
        """
        if not isinstance(model, ModelReference):
            model = parse_model_reference(os.fspath(model), flag=flag, kinds=tuple(kinds))
        return cls(model, settings or RuntimeSettings())

    @property
    def path(self) -> str:
        """The folder, or ``preset:NAME``."""
        return f"preset:{self.reference.path}" if self.reference.kind == "preset" else self.reference.path

    @property
    def answers_questions(self) -> bool:
        """A VQA model: it answers (``answer``) and has nothing to embed with."""
        return self.reference.answers_questions

    @functools.cached_property
    def encoder(self) -> Encoder:
        """The encoder (built on first use).

        Raises:
            RefusedModelError: for a question-answering model, which has no contrastive heads to embed with.
        """
        if self.answers_questions:
            raise RefusedModelError(
                f"{self.reference.path} is a question-answering model (vlfit train --task vqa): it has no "
                f"contrastive heads to embed with; ask it questions (vlfit vqa --model {self.reference.path}, or "
                "vlfit.load(...).answer), or embed with a contrastive checkpoint"
            )
        return build_encoder(self.reference, self.settings)

    @functools.cached_property
    def pair_scorer(self) -> PairScorer | None:
        """The image-text matching head on this runtime's settings (backend, precision, threads, caption length),
        whether or not the encoder was built first; None without one."""
        from vlfit.inference.pair_scorer import exported_scorer_of, pair_scorer_for

        if self.reference.kind == "export":
            return exported_scorer_of(self.reference.path, self.settings)
        return pair_scorer_for(self.encoder)  # shares the PyTorch encoder's model and threads

    @functools.cached_property
    def saved_rerank_weight(self) -> float | None:
        """The re-ranking weight the run saved beside its weights (``rerank.json``, copied by ``vlfit export``);
        None for a preset, a hub id or a run without one.

        Raises:
            ModelLoadError: naming the file, for a record that cannot be read.
        """
        from vlfit.inference.rerank_score import saved_rerank_weight

        return saved_rerank_weight(self.reference.path) if self.reference.kind in FOLDER_KINDS else None

    def rerank_score(
        self, kind: str | None = None, weight: float | None = None, *, score_flag: str = "--rerank_score",
        weight_flag: str = "--rerank_weight",
    ) -> RerankScore:  # fmt: skip
        """What this model re-ranks by: ``kind`` and ``weight`` as asked (None: the run's saved weight and its
        default, ``vlfit.inference.rerank_score.resolve_rerank_score``), refused in one line naming the flags."""
        from vlfit.inference.rerank_score import resolve_rerank_score

        return resolve_rerank_score(kind, weight, self.saved_rerank_weight, score_flag=score_flag,
                                    weight_flag=weight_flag)  # fmt: skip

    def require_pair_scorer(self) -> PairScorer:
        """``pair_scorer``, refused in one line when the model has no matching head.

        Raises:
            NoMatchingHeadError: naming the folder and how to train a model with one.
        """
        from vlfit.inference.exported import ExportFolder
        from vlfit.inference.pair_scorer import no_matching_head

        scorer = self.pair_scorer
        if scorer is None:
            path = self.reference.path
            raise no_matching_head(path, ExportFolder.open(path) if self.reference.kind == "export" else None)
        return scorer

    @functools.cached_property
    def answerer(self) -> QuestionAnswerer:
        """The VQA head (built on first use).

        Raises:
            ConfigError: for a model without one.
        """
        from vlfit.inference.vqa import QuestionAnswerer

        if not self.answers_questions:
            raise ConfigError(
                f"{self.reference.path} has no VQA head: answering questions needs a model trained with vlfit train "
                "--task vqa"
            )
        return QuestionAnswerer(self.reference, self.settings.max_seq_length, self.settings.num_threads)

    @property
    def inputs(self) -> InputSpec:
        """The caption length, image size, mean, std and tokenizer every part takes."""
        return self.answerer.inputs if self.answers_questions else self.encoder.spec

    @property
    def image_size(self) -> int:
        return self.inputs.image_size

    @functools.cached_property
    def image_inputs(self) -> ImageInputs:
        """The one image path of this model, built once from its input spec: every door's image batches."""
        return ImageInputs(self.inputs)

    def pixels(self, images: ImageInput | Iterable[ImageInput], start: int = 0) -> torch.Tensor:
        """Images (paths, encoded bytes, PIL images, uint8 arrays ``[H, W(, C)]`` or one ``[N, H, W, C]`` batch)
        as the fast CPU pipeline makes them: uint8 ``[N, 3, S, S]`` (center crop, bicubic resize), in one copy.
        ``start`` numbers them in error messages."""
        if self.image_inputs.naflex:
            raise ConfigError(
                f"{self.path} is a NaFlex model: its images are patches with a mask and grids (image_batch), not "
                "square pixels"
            )
        return self.image_inputs.batch(images, start)["pixels"]

    def image_batch(self, images: ImageInput | Iterable[ImageInput], start: int = 0) -> ImageBatch:
        """The encoder's image inputs of ``images`` (``encoder.encode_images(**batch)``): ``pixels`` (``pixels()``);
        for a NaFlex model, uint8 patches padded to the longest image's count with ``pixel_attention_mask`` and
        ``spatial_shapes`` (``vlfit.data.naflex``), at the run's token budget."""
        return self.image_inputs.batch(images, start)

    def embed_images(self, images: ImageInput | Iterable[ImageInput], batch_size: int = 32) -> torch.Tensor:
        """L2-normalized float32 ``[N, D]``, ``batch_size`` images at a time."""
        items = image_list(images)
        rows = [self.encoder.encode_images(**self.image_batch(items[s : s + batch_size], s))
                for s in range(0, len(items), batch_size)]  # fmt: skip
        return self._stacked(rows)

    def embed_texts(self, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
        """L2-normalized float32 ``[N, D]``, ``batch_size`` captions at a time (each batch padded to its longest)."""
        rows = [self.encoder.encode_texts(texts[s : s + batch_size]) for s in range(0, len(texts), batch_size)]
        return self._stacked(rows)

    def _stacked(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The batches' embeddings as one float32 ``[N, D]`` (``[0, D]`` for none)."""
        return torch.cat(rows).float() if rows else torch.zeros(0, self.encoder.identity.embedding_size)

    def answer(
        self, images: ImageInput | Iterable[ImageInput], questions: Sequence[str], top_k: int = 3, batch_size: int = 32
    ) -> list[list[Answer]]:
        """The ``top_k`` best answers to each question about its image (one image per question, or one for all),
        ``batch_size`` questions to a forward.

        Raises:
            DataError: for as many images as questions but not one per question, or an image that cannot be read.
        """
        items = image_list(images)
        if len(items) == 1:
            items = items * len(questions)
        if len(items) != len(questions):
            raise DataError(f"{len(items)} images for {len(questions)} questions: give one image per question, or one")
        answers: list[list[Answer]] = []
        for start in range(0, len(questions), batch_size):
            pixels = self.pixels(items[start : start + batch_size], start)
            answers += self.answerer.answer(pixels, questions[start : start + batch_size], top_k)
        return answers

    def __repr__(self) -> str:
        if self.answers_questions:
            return f"ModelRuntime(question answering {self.reference.path} on torch)"
        if "encoder" in self.__dict__:
            return f"ModelRuntime({self.encoder.description})"
        return f"ModelRuntime({self.path}, {self.settings})"
