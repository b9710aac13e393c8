"""VQA accuracy against hand-computed cases: the official normalisation and the 10-choose-9 averaging."""

import pytest

from vlfit.data.answer_normalization import normalize_answer
from vlfit.evaluation.vqa_accuracy import answer_accuracy, vqa_metrics


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("Two", "2"),  # number words
        ("the dog", "dog"),  # articles
        ("a red ball.", "red ball"),  # periods outside numbers go
        ("3.5", "3.5"),  # inside a number they stay
        ("dont", "don't"),  # contractions
        ("yes!", "yes"),  # punctuation
        ("black-and-white", "black and white"),  # punctuation between words is a space
        ("1,000", "1000"),  # a comma inside a number goes
        ("  Tab\there ", "tab here"),
    ],
)
def test_normalisation(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_ten_answers_average_the_ten_subsets_of_nine():
    # 3 of 10 said yes: leaving out a "yes" leaves 2/3 (three times), leaving out a "no" leaves 3/3 (seven times).
    assert answer_accuracy("yes", ["yes"] * 3 + ["no"] * 7) == pytest.approx((3 * 2 / 3 + 7 * 1) / 10)
    assert answer_accuracy("yes", ["yes"] * 2 + ["no"] * 8) == pytest.approx((2 * 1 / 3 + 8 * 2 / 3) / 10)
    assert answer_accuracy("Yes.", ["yes"] * 10) == 1.0  # normalised before comparing
    assert answer_accuracy("two", ["2"] * 4 + ["3"] * 6) == 1.0  # 4 matches: 3 or more in every subset
    assert answer_accuracy("maybe", ["yes"] * 10) == 0.0


def test_fewer_answers_score_against_their_number():
    assert answer_accuracy("cat", ["cat"]) == 1.0  # a single multiple-choice answer is matched exactly
    assert answer_accuracy("cat", ["cat", "dog", "dog"]) == pytest.approx(1 / 3)


def test_metrics_per_answer_type():
    metrics = vqa_metrics(
        ["yes", "2", "red"],
        [["yes"] * 10, ["3"] * 10, ["red"] * 10],
        ["yes/no", "number", "other"],
    )
    assert metrics == {
        "vqa_accuracy": pytest.approx(2 / 3),
        "vqa_accuracy_number": 0.0,
        "vqa_accuracy_other": 1.0,
        "vqa_accuracy_yes_no": 1.0,
    }


def test_metrics_per_question_type_beside_answer_type():
    metrics = vqa_metrics(
        ["yes", "no", "2", "left"],
        [["yes"] * 10, ["yes"] * 10, ["2"] * 10, ["right"] * 10],
        ["yes/no", "yes/no", "number", "other"],
        question_types=["is there", "is there", "how many", None],  # a row without a type counts only overall
    )
    assert metrics == {
        "vqa_accuracy": pytest.approx(2 / 4),
        "vqa_accuracy_number": 1.0,
        "vqa_accuracy_other": 0.0,
        "vqa_accuracy_yes_no": pytest.approx(1 / 2),
        "vqa_accuracy_question_type_how_many": 1.0,
        "vqa_accuracy_question_type_is_there": pytest.approx(1 / 2),
    }
