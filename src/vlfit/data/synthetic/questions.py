"""Synthetic visual questions about the drawn scenes, in the VQAv2 layout (``vlfit make-data --task vqa``).

Each row is one scene (drawn as the caption dataset of the same seed draws it) and one question about it, of four
kinds: ``how many`` (a shape kind, counted over the scene; absent kinds count 0), ``what colour`` (of a kind that
one group holds), ``is there`` (a colour and kind, present or not, half each) and ``where`` (the region of a group:
left, right, top, bottom, center). Ten annotators answer it; each gives a plausible wrong answer of the same kind
with probability ``DISAGREEMENT`` (one more or fewer, another colour, the other of yes and no, another region), so
some questions have disagreeing answers, as VQAv2's do.

Columns: ``image``, ``question``, ``answers`` (10 strings), ``multiple_choice_answer`` (the most given),
``answer_type`` (``yes/no``, ``number``, ``other``), ``question_type``, ``question_id``, ``image_id``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import datasets
import numpy as np

from vlfit.data.synthetic.dataset import generate_splits
from vlfit.data.synthetic.render import render_scene
from vlfit.data.synthetic.scenes import (
    COLOUR_NAMES,
    KINDS,
    PLURALS,
    REGION_PHRASES,
    REGIONS,
    Scene,
    SyntheticConfig,
    scene_and_choices,
)
from vlfit.errors import DataError

ANNOTATORS = 10
DISAGREEMENT = 0.1
QUESTION_TYPES: dict[str, str] = {  # question type -> VQAv2 answer type
    "how many": "number",
    "what colour": "other",
    "is there": "yes/no",
    "where": "other",
}
QUESTION_FEATURES = datasets.Features(
    {
        "image": datasets.Image(),
        "question": datasets.Value("string"),
        "answers": datasets.List(datasets.Value("string")),
        "multiple_choice_answer": datasets.Value("string"),
        "answer_type": datasets.Value("string"),
        "question_type": datasets.Value("string"),
        "question_id": datasets.Value("int64"),
        "image_id": datasets.Value("string"),
    }
)


def _noun(kind: str, count: int) -> str:
    return kind if count == 1 else PLURALS[kind]


def ask(scene: Scene, question_type: str, rng: np.random.Generator) -> tuple[str, str]:
    """A question of ``question_type`` about ``scene`` and its true answer."""
    if question_type == "how many":
        # A kind the scene holds three times in four, so that counts of 0 do not dominate.
        kinds = [group.kind for group in scene] if rng.random() < 0.75 else list(KINDS)
        kind = kinds[rng.integers(len(kinds))]
        count = sum(group.count for group in scene if group.kind == kind)
        return f"how many {PLURALS[kind]} are there?", str(count)
    if question_type == "is there":
        if rng.random() < 0.5:
            group = scene[rng.integers(len(scene))]
            return f"is there a {group.colour} {group.kind}?", "yes"
        present = {(group.colour, group.kind) for group in scene}
        while True:
            colour, kind = COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))], KINDS[rng.integers(len(KINDS))]
            if (colour, kind) not in present:
                return f"is there a {colour} {kind}?", "no"
    group = scene[rng.integers(len(scene))]
    if question_type == "what colour":
        same_kind = [other for other in scene if other.kind == group.kind]
        if len(same_kind) > 1:  # two groups of the kind: ask about the region-named one
            verb = "is" if group.count == 1 else "are"
            where = REGION_PHRASES[group.region]
            return f"what colour {verb} the {_noun(group.kind, group.count)} {where}?", group.colour
        verb = "is" if group.count == 1 else "are"
        return f"what colour {verb} the {_noun(group.kind, group.count)}?", group.colour
    if question_type == "where":
        verb = "is" if group.count == 1 else "are"
        return f"where {verb} the {group.colour} {_noun(group.kind, group.count)}?", group.region
    raise DataError(f"unknown question type {question_type!r}; choose one of: {', '.join(QUESTION_TYPES)}")


def _wrong_answer(question_type: str, answer: str, rng: np.random.Generator) -> str:
    """A plausible answer other than ``answer`` to a question of ``question_type``."""
    if question_type == "how many":
        count = int(answer)
        return str(count + 1 if count == 0 or rng.random() < 0.5 else count - 1)
    if question_type == "is there":
        return "no" if answer == "yes" else "yes"
    values = COLOUR_NAMES if question_type == "what colour" else REGIONS
    others = [value for value in values if value != answer]
    return others[rng.integers(len(others))]


def annotate(question_type: str, answer: str, rng: np.random.Generator) -> list[str]:
    """``ANNOTATORS`` answers: the true one, each replaced by a wrong one with probability ``DISAGREEMENT``."""
    return [
        _wrong_answer(question_type, answer, rng) if rng.random() < DISAGREEMENT else answer for _ in range(ANNOTATORS)
    ]


def make_question_record(index: int, config: SyntheticConfig) -> dict[str, Any]:
    """One row: the scene of row ``index`` of the caption dataset of ``config`` (the same image) and a question
    about it, its type drawn in turn (``QUESTION_TYPES`` order, then at random within each cycle of four)."""
    rng = np.random.default_rng([config.seed, index])
    scene, _, _ = scene_and_choices(rng, grammar=config.caption_grammar)
    jpeg = render_scene(scene, rng, config)
    asking = np.random.default_rng([config.seed, index, 1])  # the question's own draws: the image stays the same
    question_type = tuple(QUESTION_TYPES)[index % len(QUESTION_TYPES)]
    question, answer = ask(scene, question_type, asking)
    answers = annotate(question_type, answer, asking)
    counts = Counter(answers)
    return {
        "image": {"bytes": jpeg, "path": None},
        "question": question,
        "answers": answers,
        "multiple_choice_answer": min(counts, key=lambda a: (-counts[a], a)),
        "answer_type": QUESTION_TYPES[question_type],
        "question_type": question_type,
        "question_id": index,
        "image_id": f"synthetic-{config.seed}-{index:07d}",
    }


def make_question_dataset(config: SyntheticConfig, num_proc: int = 1) -> datasets.DatasetDict:
    """The train / validation / test splits of synthetic questions (``SPLITS``, sizes as ``split_sizes``).

    Raises:
        DataError: for ``config.labels`` (a labelled set has no questions) or a bad ``num_proc``.
    """
    if config.labels:
        raise DataError("--labels makes a labelled set for vlfit fewshot; --task vqa writes questions: drop one")
    return generate_splits(config, QUESTION_FEATURES, make_question_record, num_proc, " questions")
