"""``--task vqa``: fine-tune and evaluate BridgeTower on visual questions, through the run's one input pipeline.

What changes against a retrieval run (``vlfit.training.run`` asks this module at two points, and the data flags at
one):

- the data (``DataArguments.run_source_kwargs``): the caption is the question (``--caption_column`` defaults to
  ``question``) and the answers travel per row as record columns (``vlfit.data.vqa.VQA_COLUMNS``, kept in
  ``Batch.columns``);
- the model (``vqa_blueprint``): ``vlfit.models.vqa.VqaFamily``, its config listing the answer vocabulary, the
  ``--max_answers`` answers the training split gives most (kept from the model for evaluation alone);
- the trainer (``VqaTrainer``): the loss is ``vqa_loss`` against the soft targets of each row's answers, and an
  evaluation reports VQA accuracy (overall, per answer type and per question type where the data has
  ``answer_type`` and ``question_type``) beside the majority-answer baseline.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from vlfit.arguments.flag_rules import check_vocabulary_is_trained
from vlfit.data.batch import Batch
from vlfit.data.records import EVAL_COLUMNS
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.vqa import (
    VQA_COLUMNS,
    AnswerVocabulary,
    batch_answers,
    ranked_answers,
    split_answers,
)
from vlfit.errors import ConfigError
from vlfit.evaluation.vqa_accuracy import answer_accuracy, vqa_metrics
from vlfit.models.loading import ModelSpec
from vlfit.models.reference import parse_model_reference
from vlfit.models.vqa import VQA_INPUTS, VqaFamily, config_answers, is_vqa_config, vqa_loss, with_answers
from vlfit.training.trainer import VlfitTrainer

logger = logging.getLogger(__name__)

# The config key of a VQA model's majority answer: the answer its training split gave most, the baseline evaluation
# reports (an --answer_vocabulary file's order says nothing of how often its answers were given).
MAJORITY_ANSWER_KEY = "vqa_majority_answer"
# A stream has no length to count answers over: its answers come from a file, or from a VQA model's own.
STREAMED_WITHOUT_VOCABULARY = (
    "--task vqa on a streamed training split: the answer vocabulary cannot be counted from a stream; give the "
    "answers with --answer_vocabulary FILE (one per line), or read the training split map-style"
)


def check_streamed_answers(
    task: str,
    *,
    streamed: bool,
    vocabulary_file: str | None,
    model_preset: str | None,
    model_name_or_path: str | None,
) -> None:
    """Refuse, before any data opens or tokenizer trains, a ``--task vqa`` training run on a streamed split that
    has no answers to learn: no ``--answer_vocabulary`` and a model without a VQA head of its own (a preset, or a
    local checkpoint that answers no questions). A hub id is left to ``vqa_blueprint``, which reads its config.

    Raises:
        ConfigError: naming ``--answer_vocabulary`` and what to do.
    """
    if task != "vqa" or not streamed or vocabulary_file is not None:
        return
    if model_preset is not None or (
        model_name_or_path is not None
        and os.path.exists(model_name_or_path)
        and not parse_model_reference(model_name_or_path).answers_questions
    ):
        raise ConfigError(STREAMED_WITHOUT_VOCABULARY)


def vqa_blueprint(
    blueprint: ModelSpec,
    train_source: ImageTextSource | None,
    eval_source: ImageTextSource | None,
    max_answers: int,
    *,
    train: bool,
    vocabulary_file: str | None = None,
) -> ModelSpec:
    """The spec of the VQA model a run trains or evaluates, its answers in its config.

    Training takes the answers of ``vocabulary_file`` (``--answer_vocabulary``) when given, else builds them from
    the training split's answers (every question's answers are checked here, before any weights load); a streamed
    training split without the file trains a VQA model's own answers. Evaluation alone takes the model's own.

    Raises:
        ConfigError: for a model that is not BridgeTower, a streamed training split with neither the file nor a
            VQA model, or an evaluation alone of a model without a VQA head.
        DataError: for a split without answers, a question without answers, an answer column of the wrong type or
            an unreadable vocabulary file.
    """
    family = blueprint.family
    if family.name != "bridgetower":
        raise ConfigError(
            f"--task vqa fine-tunes BridgeTower (its fused tower answers questions); {blueprint.description} is a "
            f"{family.name} model, a dual encoder without one"
        )
    if eval_source is not None:
        split_answers(eval_source)  # a bad question fails now, not at the end of training
    check_vocabulary_is_trained(vocabulary_file, train=train)
    answers: list[list[str]] | None = None
    if vocabulary_file is not None:
        vocabulary = AnswerVocabulary.read(vocabulary_file)
        if train_source is not None:
            answers = split_answers(train_source)
            logger.info("answer vocabulary: %d answers of %s, %.1f%% of the training split's annotator answers",
                        len(vocabulary), vocabulary_file, 100 * vocabulary.coverage(answers))  # fmt: skip
        config = with_answers(blueprint.config, vocabulary.answers)
    elif train and train_source is None and not is_vqa_config(blueprint.config):
        raise ConfigError(STREAMED_WITHOUT_VOCABULARY)
    elif train_source is not None:
        answers = split_answers(train_source)
        vocabulary = AnswerVocabulary.build(answers, max_answers)
        logger.info(
            "answer vocabulary: %d answers of the training split (%d distinct), %.1f%% of its annotator answers",
            len(vocabulary), len({a for row in answers for a in row}), 100 * vocabulary.coverage(answers),
        )  # fmt: skip
        config = with_answers(blueprint.config, vocabulary.answers)
    elif is_vqa_config(blueprint.config):
        config = blueprint.config
    else:
        raise ConfigError(f"{blueprint.description} has no VQA head to evaluate: train one with vlfit train --task vqa")
    if answers is not None:
        setattr(config, MAJORITY_ANSWER_KEY, ranked_answers(answers)[0])
    return replace(blueprint, family=VqaFamily(), config=config)


class VqaTrainer(VlfitTrainer):
    """``VlfitTrainer`` with the VQA loss and VQA accuracy (the model's config holds its answers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vocabulary = AnswerVocabulary(config_answers(self.model.config))
        # A model trained before the key was kept, or on a stream with a vocabulary file, falls back to the first
        # answer (a vocabulary built from the data is most given first).
        self.majority_answer = getattr(self.model.config, MAJORITY_ANSWER_KEY, None) or self.vocabulary.answers[0]

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        super()._save(output_dir, state_dict=state_dict)
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "peft_config"):  # LoRA adapters alone do not list the answers: their base's config does
            model.get_base_model().config.save_pretrained(output_dir or self.args.output_dir)  # not (or other ones)

    def compute_loss(
        self, model: torch.nn.Module, inputs: Batch, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        logits = model(**{key: inputs.inputs[key] for key in VQA_INPUTS}).logits
        targets = self.vocabulary.targets(batch_answers(inputs.columns, inputs.sample_ids), device=logits.device)
        loss = vqa_loss(logits, targets)
        return (loss, logits) if return_outputs else loss

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        metrics = self.vqa_metrics(self.get_eval_dataloader(eval_dataset))
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def vqa_metrics(self, loader: Any) -> dict[str, float]:
        """VQA accuracy of the top answer (overall, per ``answer_type`` and per ``question_type``), and the
        majority-answer baseline's (the answer the training split gave most, for every question)."""
        model = self.model
        was_training = model.training
        model.eval()
        dtype = next(model.parameters()).dtype
        rows: list[tuple[int, str, list[str], Any, Any]] = []
        batches = self.pipeline.feed(loader, dtype, train=False)
        show = not (self.args.disable_tqdm or not self.is_local_process_zero())
        with torch.no_grad(), self.autocast_smart_context_manager():
            for batch in tqdm(batches, total=len(loader), desc="eval", unit="batch", leave=False, disable=not show):
                if not len(batch):
                    continue
                logits = model(**{key: batch.inputs[key] for key in VQA_INPUTS}).logits
                best = logits.argmax(dim=-1).tolist()
                answers = batch_answers(batch.columns, batch.sample_ids)
                types = batch.columns.get("answer_type") or [None] * len(batch)
                questions = batch.columns.get("question_type") or [None] * len(batch)
                for position, index, given, kind, question in zip(
                    batch.positions, best, answers, types, questions, strict=True
                ):
                    rows.append((position, self.vocabulary.answers[index], given, kind, question))
        model.train(was_training)
        if self.accelerator.num_processes > 1:
            rows = gather_object(rows)
        unique = sorted({row[0]: row for row in rows}.values())  # a padded last batch repeats rows
        if not unique:
            return {"vqa_accuracy": 0.0, "vqa_questions": 0}
        answer_types = [row[3] for row in unique]
        question_types = [row[4] for row in unique]
        metrics = vqa_metrics(
            [row[1] for row in unique],
            [row[2] for row in unique],
            answer_types if any(answer_types) else None,
            question_types=question_types if any(question_types) else None,
        )
        scores = [answer_accuracy(self.majority_answer, row[2]) for row in unique]
        metrics["vqa_accuracy_majority_answer"] = sum(scores) / len(scores)
        metrics["vqa_questions"] = len(unique)
        return metrics


def trainer_class(family: Any, contrastive: type[VlfitTrainer] = VlfitTrainer) -> type[VlfitTrainer]:
    """``VqaTrainer`` for a VQA model's family, else ``contrastive`` (the run's trainer class)."""
    return VqaTrainer if isinstance(family, VqaFamily) else contrastive


def pipeline_columns(task: str) -> tuple[str, ...]:
    """The record columns a run's batches carry for ``task``: the answers, or evaluation's caption choices."""
    return VQA_COLUMNS if task == "vqa" else EVAL_COLUMNS
