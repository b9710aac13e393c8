"""Visual question answering data: the VQAv2 columns, each question's annotator answers, the answer vocabulary
and the soft targets the classifier trains on.

A VQA split is an image-text split whose text is the question (``--caption_column`` defaults to ``question``),
with the answers carried per row as record columns (``VQA_COLUMNS``) through the same sources, collator and
device stage as captions: ``Batch.columns`` holds them, and the loss turns them into targets on the device.

VQAv2's layout: ``answers`` is a list of annotator answers, as strings or as dicts with an ``answer`` key (the hub
form, with ``answer_confidence`` and ``answer_id``); without it, ``multiple_choice_answer`` is the one answer;
``answer_type`` (yes/no, number, other) and ``question_type`` are optional, as are ``question_id`` and
``image_id``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlfit.data.answer_normalization import normalize_answer
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import DataError

QUESTION_COLUMN = "question"
ANSWERS_COLUMN = "answers"
MULTIPLE_CHOICE_COLUMN = "multiple_choice_answer"
ANSWER_TYPE_COLUMN = "answer_type"
QUESTION_TYPE_COLUMN = "question_type"
# The record columns a VQA split carries per row (those present; the question is the caption).
VQA_COLUMNS: tuple[str, ...] = (ANSWERS_COLUMN, MULTIPLE_CHOICE_COLUMN, ANSWER_TYPE_COLUMN, QUESTION_TYPE_COLUMN)
# VQAv2's usual answer vocabulary: the answers given at least 9 times in its training split.
DEFAULT_MAX_ANSWERS = 3129


def annotator_answers(columns: Mapping[str, Any], sample_id: str) -> list[str]:
    """The annotators' answers to one question, normalised (``normalize_answer``), in the order given.

    Raises:
        DataError: naming the question, when it has no answer (an empty or missing ``answers`` and no
            ``multiple_choice_answer``), or when the column holds something other than a list of answers.
    """
    value = columns.get(ANSWERS_COLUMN)
    if value is None:
        single = columns.get(MULTIPLE_CHOICE_COLUMN)
        if single is None or (isinstance(single, str) and not single.strip()):
            raise DataError(
                f"question {sample_id} has no answers: its {ANSWERS_COLUMN!r} and {MULTIPLE_CHOICE_COLUMN!r} are "
                "empty or missing; every VQA question needs at least one annotator answer"
            )
        if not isinstance(single, str):
            raise DataError(
                f"question {sample_id}: {MULTIPLE_CHOICE_COLUMN!r} holds {type(single).__name__}, expected the "
                "answer as text"
            )
        return [normalize_answer(single)]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise DataError(
            f"question {sample_id}: the {ANSWERS_COLUMN!r} column holds {type(value).__name__}, expected a list of "
            "annotator answers (strings, or dicts with an 'answer' key as VQAv2 has them)"
        )
    answers = []
    for item in value:
        text = item.get("answer") if isinstance(item, Mapping) else item
        if not isinstance(text, str):
            raise DataError(
                f"question {sample_id}: the {ANSWERS_COLUMN!r} column holds a {type(item).__name__} answer "
                f"({item!r:.60}), expected strings or dicts with an 'answer' string"
            )
        answers.append(normalize_answer(text))
    if not answers:
        return annotator_answers({**columns, ANSWERS_COLUMN: None}, sample_id)  # the multiple-choice answer, if any
    return answers


def batch_answers(columns: Mapping[str, Sequence[Any]], sample_ids: Sequence[str]) -> list[list[str]]:
    """``annotator_answers`` of every row of a batch (``Batch.columns`` and ``Batch.sample_ids``)."""
    return [
        annotator_answers({name: values[row] for name, values in columns.items()}, sample_id)
        for row, sample_id in enumerate(sample_ids)
    ]


def check_has_answers(source: ImageTextSource) -> None:
    """Refuse a split with neither an ``answers`` nor a ``multiple_choice_answer`` column (from its column names
    alone: a run checks this when its splits open, before a tokenizer is trained or a model built).

    Raises:
        DataError: naming the split, the columns it needs and those it has.
    """
    if not {ANSWERS_COLUMN, MULTIPLE_CHOICE_COLUMN} & set(source.column_names):
        raise DataError(
            f"{source.name} has no answers: a VQA split (--task vqa) needs an {ANSWERS_COLUMN!r} column (a list of "
            f"annotator answers) or a {MULTIPLE_CHOICE_COLUMN!r} column; its columns: {', '.join(source.column_names)}"
        )


def split_answers(source: ImageTextSource) -> list[list[str]]:
    """Every question's annotator answers in a split, in index order.

    Raises:
        DataError: for a split with neither an ``answers`` nor a ``multiple_choice_answer`` column
            (``check_has_answers``), and for a question without answers or with answers of the wrong type
            (``annotator_answers``).
    """
    check_has_answers(source)
    return [annotator_answers(record.extra, record.id) for record in source]


def ranked_answers(answers: Iterable[Sequence[str]]) -> list[str]:
    """The distinct answers, most given first (every annotator's answer counted once; ties by name)."""
    counts = Counter(answer for row in answers for answer in row)
    return sorted(counts, key=lambda answer: (-counts[answer], answer))


@dataclass(frozen=True)
class AnswerVocabulary:
    """The answers the classifier chooses from, most frequent first (index = output unit).

    Attributes:
        answers: The normalised answers, most frequent in the training split first (ties by name).
    """

    answers: tuple[str, ...]

    @classmethod
    def build(cls, answers: Iterable[Sequence[str]], max_answers: int = DEFAULT_MAX_ANSWERS) -> AnswerVocabulary:
        """The ``max_answers`` answers given most often, counting every annotator's answer once."""
        if max_answers < 1:
            raise DataError(f"--max_answers must be at least 1, got {max_answers}")
        ranked = ranked_answers(answers)
        if not ranked:
            raise DataError("the training split has no answers to build an answer vocabulary from")
        return cls(tuple(ranked[:max_answers]))

    @classmethod
    def read(cls, path: str) -> AnswerVocabulary:
        """The answers of a file (``--answer_vocabulary``), in the file's order: one answer per line, a JSON list of
        answers, or a JSON ``{answer: index}`` map (METER's and ViLT's ``ans2label``), each answer normalised as the
        data's are; a repeated answer keeps its first place.

        Raises:
            DataError: naming the file, when it cannot be read, is not one of those forms or holds no answer.
        """
        flag = "--answer_vocabulary"
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"{flag} {path}: cannot read it ({error})") from error
        if path.endswith(".json"):
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as error:
                raise DataError(f"{flag} {path}: not valid JSON ({error})") from error
            if isinstance(loaded, Mapping) and all(isinstance(v, int) for v in loaded.values()):
                loaded = sorted(loaded, key=lambda answer: loaded[answer])
            if not isinstance(loaded, list) or not all(isinstance(answer, str) for answer in loaded):
                raise DataError(
                    f"{flag} {path}: expected a JSON list of answers or an {{answer: index}} map, got "
                    f"{type(loaded).__name__}"
                )
            given = loaded
        else:
            given = text.splitlines()
        answers = tuple(dict.fromkeys(normalize_answer(answer) for answer in given if answer.strip()))
        if not answers:
            raise DataError(f"{flag} {path} holds no answer: write one answer per line (or a JSON list)")
        return cls(answers)

    def __len__(self) -> int:
        return len(self.answers)

    def coverage(self, answers: Sequence[Sequence[str]]) -> float:
        """The share of annotator answers the vocabulary holds (what the classifier can say)."""
        known = set(self.answers)
        total = sum(len(row) for row in answers)
        return sum(answer in known for row in answers for answer in row) / total if total else 0.0

    def targets(
        self,
        answers: Sequence[Sequence[str]],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Soft targets ``[B, len(self)]``: ``min(1, count / 3)`` for each answer ``count`` annotators gave (VQAv2's;
        with fewer than 3 answers, ``count / len(answers)``), 0 for the rest; answers outside the vocabulary drop out.
        """
        index = {answer: i for i, answer in enumerate(self.answers)}
        rows, cols, values = [], [], []
        for row, given in enumerate(answers):
            bar = min(3, len(given))
            for answer, count in Counter(given).items():
                if answer in index:
                    rows.append(row)
                    cols.append(index[answer])
                    values.append(min(1.0, count / bar))
        targets = torch.zeros(len(answers), len(self), dtype=dtype)
        if rows:
            targets[rows, cols] = torch.tensor(values, dtype=dtype)
        return targets.to(device, non_blocking=True)
