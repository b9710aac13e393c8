"""Which flags each ``--task`` takes: a flag of the other task is refused in one line before any data opens, instead
of being ignored (or failing at the first step, or crashing)."""

from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.errors import ConfigError
from vlfit.models.reference import parse_model_reference
from vlfit.training.arguments import VlfitTrainingArguments

# Flags of a retrieval run: its contrastive or matching loss, and its retrieval and zero-shot evaluation. A --task vqa
# run trains with the VQA loss and reports VQA accuracy: none of them would do anything there.
RETRIEVAL_FLAGS = ("objective", "contrastive_loss", "contrastive_negatives", "gradient_cache_chunk_size",
                   "logit_scale_init_value", "hard_negative_column", "eval_pool_size", "rerank_top_k",
                   "zeroshot_dataset", "prompt_template")  # fmt: skip
# Flags of a --task vqa run: its answers.
VQA_FLAGS = ("answer_vocabulary", "max_answers")


def check_task_flags(
    task: str, model_args: ModelArguments, data_args: DataArguments, training_args: VlfitTrainingArguments
) -> None:
    """Refuse a flag of the other task (``RETRIEVAL_FLAGS`` on a ``--task vqa`` run, ``VQA_FLAGS`` on a retrieval
    run) set to other than its default; ``--answer_vocabulary`` on an evaluation alone; and ``--wise_ft_alpha`` on a
    VQA run whose model has no VQA head to mix with (the head starts at random).

    Raises:
        ConfigError: naming the flag and what to do.
    """
    vqa = task == "vqa"
    for flags in (model_args, data_args, training_args):
        for flag in fields(flags):
            if flag.name in (RETRIEVAL_FLAGS if vqa else VQA_FLAGS) and getattr(flags, flag.name) != _default(flag):
                if vqa:
                    raise ConfigError(f"--{flag.name} is a retrieval run's flag; --task vqa trains with the VQA loss "
                                      "and reports VQA accuracy: drop it")  # fmt: skip
                raise ConfigError(f"--{flag.name} is a flag of --task vqa (its answers); this run is a retrieval run: "
                                  "add --task vqa or drop it")  # fmt: skip
    if not vqa:
        return
    train, model = training_args.do_train, model_args.model_name_or_path
    check_vocabulary_is_trained(data_args.answer_vocabulary, train=train)
    mixes = training_args.wise_ft_alpha is not None and train
    if mixes and not (model and parse_model_reference(model).answers_questions):
        raise ConfigError(
            f"--wise_ft_alpha mixes the trained weights with the starting ones, and {model or 'a preset'} has no VQA "
            "head to mix (the run's starts at random): drop the flag, or start from a --task vqa run's folder"
        )


def check_vocabulary_is_trained(vocabulary_file: str | None, *, train: bool) -> None:
    """Refuse ``--answer_vocabulary`` on an evaluation alone: it scores the model's own answers.

    Raises:
        ConfigError: naming the flag.
    """
    if vocabulary_file is not None and not train:
        raise ConfigError("--answer_vocabulary sets the answers a training run learns; an evaluation alone scores "
                          "the model's own answers: drop the flag")  # fmt: skip


def _default(flag: Field) -> Any:
    if flag.default is not MISSING:
        return flag.default
    return flag.default_factory() if flag.default_factory is not MISSING else MISSING
