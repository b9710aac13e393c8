"""Answering questions about images with a model ``vlfit train --task vqa`` saved (PyTorch, on the CPU or a GPU).

Images arrive as the fast CPU pipeline makes them (uint8 ``[B, 3, S, S]``) and are normalised here as the training
device stage does; questions are tokenized as training tokenized them. Each answer's score is the sigmoid of its
logit (the classifier is trained with binary cross-entropy on soft targets, so scores do not sum to 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from vlfit.data.normalize import normalize_uint8
from vlfit.errors import ConfigError
from vlfit.models.family import InputSpec
from vlfit.models.loading import LoadedModel, build_model, resolve_model
from vlfit.models.reference import ModelReference
from vlfit.models.vqa import VQA_ARCHITECTURE, config_answers, is_vqa_config
from vlfit.threads import on_own_threads


class Answer(NamedTuple):
    """One answer to a question and its score (the sigmoid of its logit, in 0..1)."""

    answer: str
    score: float


class QuestionAnswerer:
    """A BridgeTower VQA model, its answers and its inputs.

    Built by ``vlfit.inference.runtime.ModelRuntime.answerer``, which batches the questions.

    Args:
        model: A folder ``vlfit train --task vqa`` wrote (or a hub id of one), or what it parsed to.
        max_seq_length: Question length (``None``: the run's, ``input_spec.json``).
        num_threads: Torch intra-op threads of each call (``None``: the process's), set for the call and put back
            after it (``vlfit.threads.torch_threads``).

    Raises:
        ConfigError: for a model without a VQA head.
    """

    def __init__(
        self, model: str | ModelReference, max_seq_length: int | None = None, num_threads: int | None = None
    ) -> None:
        model_path = model.path if isinstance(model, ModelReference) else model
        self.model_path = model_path
        self.num_threads = num_threads
        spec = resolve_model(model_name_or_path=model, max_seq_length=max_seq_length)
        if not is_vqa_config(spec.config):
            raise ConfigError(
                f"{model_path} has no VQA head (its config names no {VQA_ARCHITECTURE}): answering questions needs "
                "a model trained with vlfit train --task vqa"
            )
        self.loaded = LoadedModel(build_model(spec).eval(), spec)
        self.answers = config_answers(spec.config)
        self._mean = torch.tensor(spec.inputs.image_mean, dtype=torch.float32)
        self._std = torch.tensor(spec.inputs.image_std, dtype=torch.float32)

    @property
    def inputs(self) -> InputSpec:
        """The question length, image size, mean, std and tokenizer the model was trained with."""
        return self.loaded.inputs

    @property
    def image_size(self) -> int:
        return self.loaded.image_size

    @on_own_threads
    @torch.inference_mode()
    def answer(self, pixels: torch.Tensor, questions: Sequence[str], top_k: int = 3) -> list[list[Answer]]:
        """The ``top_k`` best answers to each question about its image, best first.

        Args:
            pixels: uint8 ``[B, 3, S, S]``, one image per question.
            questions: ``B`` questions.
            top_k: Answers per question (at most the vocabulary's size).
        """
        if len(questions) != len(pixels):
            raise ConfigError(f"{len(questions)} questions for {len(pixels)} images: give one image per question")
        if not questions:
            return []
        model = self.loaded.model
        device = next(model.parameters()).device
        tokens = self.loaded.inputs.tokenize(questions)
        normalized = normalize_uint8(pixels, self._mean, self._std)
        logits = model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
            pixel_values=normalized.to(device),
        ).logits
        scores, indices = logits.float().sigmoid().topk(min(top_k, len(self.answers)), dim=-1)
        return [
            [Answer(self.answers[i], float(s)) for s, i in zip(row_scores, row_indices, strict=True)]
            for row_scores, row_indices in zip(scores.tolist(), indices.tolist(), strict=True)
        ]
