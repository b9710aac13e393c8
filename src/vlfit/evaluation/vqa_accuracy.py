"""VQA accuracy as the official VQAv2 evaluation computes it (``vqaEval.py`` of the VQA API).

Answers are compared as ``vlfit.data.answer_normalization.normalize_answer`` makes them (the official
normalisation: punctuation, articles, number words, contractions). The official script normalises the
annotators' answers only where they disagree; here they always are, which changes no score (agreeing answers
compare equal either way).

A prediction scores ``min(1, matches / 3)`` against the annotators' answers; with 10 answers (VQAv2), that is
averaged over the 10 subsets of 9 (each annotator left out once), as the official evaluation does. With fewer
answers than 3 the bar is their number (a single ``multiple_choice_answer`` is matched exactly).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

from vlfit.data.answer_normalization import normalize_answer

# The answer types of VQAv2 (its ``answer_type`` column).
ANSWER_TYPES = ("yes/no", "number", "other")


def answer_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """The VQA accuracy of one predicted answer against the annotators' ``answers`` (normalised both).

    With 10 answers: the mean over each annotator left out of ``min(1, matches among the other 9 / 3)``; with
    fewer, ``min(1, matches / min(3, len(answers)))``.
    """
    if not answers:
        raise ValueError("a question needs at least one annotator answer to be scored")
    predicted = normalize_answer(prediction)
    given = [normalize_answer(answer) for answer in answers]
    if len(given) < 10:
        return min(1.0, sum(answer == predicted for answer in given) / min(3, len(given)))
    matches = sum(answer == predicted for answer in given)
    # Leaving out annotator i removes one match exactly when annotator i gave the predicted answer.
    scores = [min(1.0, (matches - (answer == predicted)) / 3) for answer in given]
    return sum(scores) / len(scores)


def vqa_metrics(
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    answer_types: Sequence[str | None] | None = None,
    prefix: str = "vqa_accuracy",
    question_types: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """Mean VQA accuracy (``{prefix}``) and, where ``answer_types`` are given, per type
    (``{prefix}_yes_no``, ``{prefix}_number``, ``{prefix}_other``: the type with ``/`` and spaces as ``_``);
    where ``question_types`` are given, per question type as well (``{prefix}_question_type_how_many``, ...).

    Args:
        predictions: One predicted answer per question.
        answers: Each question's annotator answers.
        answer_types: Each question's ``answer_type`` (``None`` where a row has none).
        prefix: The metrics' name.
        question_types: Each question's ``question_type`` (``None`` where a row has none).
    """
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} questions")
    scores = [answer_accuracy(p, a) for p, a in zip(predictions, answers, strict=True)]
    metrics = {prefix: sum(scores) / len(scores) if scores else 0.0}
    if answer_types is not None:
        metrics.update(_mean_per_group(scores, answer_types, prefix))
    if question_types is not None:
        metrics.update(_mean_per_group(scores, question_types, f"{prefix}_question_type"))
    return metrics


def _mean_per_group(scores: Sequence[float], groups: Sequence[str | None], prefix: str) -> dict[str, float]:
    """The mean score of each named group (rows without one are left out), keyed ``{prefix}_{group}`` with every
    run of characters other than lower-case letters and digits as ``_``."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for score, group in zip(scores, groups, strict=True):
        if group:
            by_group[str(group)].append(score)
    return {
        f"{prefix}_{re.sub(r'[^0-9a-z]+', '_', group.lower())}": sum(values) / len(values)
        for group, values in sorted(by_group.items())
    }
