"""BridgeTower for visual question answering: the fused tower with the paper's classifier over its pooled output.

``BridgeTowerModel``'s ``pooler_output`` is the cross-modal text and image poolers' outputs side by side (``2h``);
the head is BridgeTower's (and METER's) VQA classifier, ``Linear(2h, 4h) -> LayerNorm -> GELU -> Linear(4h,
answers)``, trained with binary cross-entropy on soft targets, scaled by the number of answers as the paper's code
does. transformers has no BridgeTower VQA class: this one is a ``BridgeTowerPreTrainedModel`` whose weights are
``bridgetower.*`` (the backbone, as every BridgeTower checkpoint names it) and ``vqa_classifier.*``, and whose
config lists the answers (``id2label``) and names ``BridgeTowerForQuestionAnswering`` in ``architectures``. Plain
transformers loads the backbone of such a folder with ``BridgeTowerModel.from_pretrained``.

``VqaFamily`` is BridgeTower's family for this model: built from a preset, loaded from a VQA folder, or started
from any BridgeTower checkpoint (a contrastive one's backbone is kept and the classifier starts at random).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import BridgeTowerConfig, BridgeTowerModel
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.bridgetower.modeling_bridgetower import BridgeTowerPreTrainedModel
from transformers.utils import logging as transformers_logging

from vlfit.errors import ConfigError
from vlfit.models import activation_checkpointing
from vlfit.models.bridgetower import BridgeTowerFamily, layer_stacks
from vlfit.models.family import LOCAL_LOSS, LossScope
from vlfit.models.reference import VQA_ARCHITECTURE, parse_model_reference

logger = logging.getLogger(__name__)

VQA_INPUTS = ("input_ids", "attention_mask", "pixel_values")


class BridgeTowerForQuestionAnswering(BridgeTowerPreTrainedModel):
    """``BridgeTowerModel`` and a classifier over its pooled fused output (``[B, 2h]`` -> ``[B, answers]``)."""

    def __init__(self, config: BridgeTowerConfig) -> None:
        super().__init__(config)
        self.bridgetower = BridgeTowerModel(config)
        hidden = config.hidden_size
        self.vqa_classifier = nn.Sequential(
            nn.Linear(2 * hidden, 4 * hidden),
            nn.LayerNorm(4 * hidden),
            nn.GELU(),
            nn.Linear(4 * hidden, config.num_labels),
        )
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        **kwargs: Any,
    ) -> SequenceClassifierOutput:
        """Answer logits ``[B, answers]`` (a sigmoid of each is its score)."""
        fused = self.bridgetower(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
        return SequenceClassifierOutput(logits=self.vqa_classifier(fused.pooler_output))


def vqa_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of ``logits`` against soft ``targets`` ``[B, answers]``, averaged and multiplied by
    the number of answers (BridgeTower's and METER's VQA loss: a sum over answers, a mean over questions)."""
    loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), targets.float())
    return loss * targets.shape[1]


def is_vqa_config(config: Any) -> bool:
    """Whether ``config`` is a BridgeTower VQA model's (its ``architectures`` names ``VQA_ARCHITECTURE``)."""
    return VQA_ARCHITECTURE in (getattr(config, "architectures", None) or ())


def config_answers(config: Any) -> tuple[str, ...]:
    """The answers of a VQA model's config, in output order (its ``id2label``)."""
    labels = config.id2label
    return tuple(labels[i] for i in range(len(labels)))


def model_answers(config: Any) -> tuple[str, ...] | None:
    """The answers of a VQA model's config, in output order; None for a model that embeds."""
    return config_answers(config) if is_vqa_config(config) else None


def with_answers(config: BridgeTowerConfig, answers: Sequence[str]) -> BridgeTowerConfig:
    """A copy of ``config`` for a VQA model answering ``answers`` (output ``i`` is ``answers[i]``)."""
    config = copy.deepcopy(config)
    config.id2label = dict(enumerate(answers))
    config.label2id = {answer: i for i, answer in enumerate(answers)}
    config.architectures = [VQA_ARCHITECTURE]
    return config


class VqaFamily(BridgeTowerFamily):
    """BridgeTower's family for ``BridgeTowerForQuestionAnswering``: the same presets, towers and attention
    kernels; its loss is ``vqa_loss`` (no contrastive heads, so no unimodal embeddings)."""

    def build(self, config: Any) -> BridgeTowerForQuestionAnswering:
        return BridgeTowerForQuestionAnswering(config)

    def from_pretrained(self, name_or_path: str, **hub_kwargs: Any) -> BridgeTowerForQuestionAnswering:
        """A VQA folder as it was saved, or any BridgeTower checkpoint's backbone with a new classifier (the
        config passed, ``with_answers``, says the answers; a VQA folder of other answers gets a new one too).

        A local checkpoint that is no VQA model (a contrastive one, the base of a VQA run's LoRA adapters) loads
        without transformers' load report, whose lines (its contrastive heads unexpected, the classifier missing)
        are what is meant; one line says so instead."""
        fresh_head = os.path.isdir(name_or_path) and not parse_model_reference(name_or_path).answers_questions
        with _transformers_quiet() if fresh_head else contextlib.nullcontext():
            model = BridgeTowerForQuestionAnswering.from_pretrained(
                name_or_path, ignore_mismatched_sizes=True, **hub_kwargs
            )
        if fresh_head:
            logger.info("%s is no VQA model: its backbone is loaded; the VQA classifier comes from LoRA adapters, or "
                        "starts at random to be trained", name_or_path)  # fmt: skip
        return model

    def head_modules(self) -> tuple[str, ...]:
        return ("vqa_classifier",)

    def prepare_for_training(self, model: nn.Module) -> None:
        activation_checkpointing.install(model, layer_stacks)  # type: ignore[arg-type]

    def encode_text(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise ConfigError("a BridgeTower VQA model has no contrastive heads: it answers questions, it does not embed")

    def encode_image(self, model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        raise ConfigError("a BridgeTower VQA model has no contrastive heads: it answers questions, it does not embed")

    def contrastive_loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], scope: LossScope = LOCAL_LOSS
    ) -> torch.Tensor:
        raise ConfigError("a BridgeTower VQA model trains with the VQA loss (--task vqa), not a contrastive one")


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers logs errors only, then as before."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
