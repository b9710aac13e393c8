"""Hard negatives from the data: which alternatives a sample gets, and how the collator lays them out."""

from __future__ import annotations

import pytest

from tests.data.image_factory import jpeg_bytes
from vlfit.data.dataset import ImageTextCollator, ImageTextDataset
from vlfit.data.hard_negatives import alternative_captions, caption_choice, right_choice, tokenize_alternatives
from vlfit.data.image_transforms import FastImageTransform
from vlfit.data.records import Record
from vlfit.models.family import HARD_NEGATIVE_ATTENTION_MASK, HARD_NEGATIVE_INPUT_IDS
from vlfit.models.tokenizer import train_caption_tokenizer

CHOICES = ["one red circle.", "two red circles.", "one blue circle.", "one red square."]


@pytest.fixture(scope="module")
def tokenizer():
    return train_caption_tokenizer(CHOICES * 20, vocab_size=300)


def test_the_label_names_the_samples_own_choice():
    # The New Yorker matching config: the caption column is another text than the choices; the label says which.
    assert alternative_captions(CHOICES, "a description", label="B") == [CHOICES[0], CHOICES[2], CHOICES[3]]
    assert alternative_captions(CHOICES, "a description", label=3) == CHOICES[:3]


def test_without_a_label_choices_equal_to_the_caption_are_left_out():
    assert alternative_captions([*CHOICES, " "], CHOICES[2]) == [CHOICES[0], CHOICES[1], CHOICES[3]]
    assert alternative_captions(None, CHOICES[0]) == []


def test_the_right_choice_follows_the_same_rule_as_the_alternatives():
    # Evaluation's matching accuracy scores against this choice; training's hard negatives are the others.
    assert right_choice(CHOICES, "B", None) == 1 and right_choice(CHOICES, 3, 0) == 3  # a label names it
    assert caption_choice(CHOICES, CHOICES[2]) == 2 and right_choice(CHOICES, None, 2) == 2  # else the caption's
    assert caption_choice(CHOICES, "not a choice") is None and caption_choice([CHOICES[0]] * 2, CHOICES[0]) is None
    assert right_choice(None, "A", 0) is None and right_choice([], None, None) is None
    with pytest.raises(ValueError, match=r"^sample s7: label 'Z' is neither a letter A-E nor an index; fix"):
        right_choice(CHOICES, "Z", None, sample_id="s7")


@pytest.mark.parametrize(
    ("choices", "label", "message"),
    [
        ("one red circle.", None, "must hold a list of caption strings, got str"),
        ([1, 2], None, "must hold a list of caption strings, got list"),
        (CHOICES, "E", "label 'E' does not point into its 4 'caption_choices' entries"),
    ],
)
def test_bad_choices_name_the_sample_and_the_column(choices, label, message):
    with pytest.raises(ValueError, match="sample s7: ") as err:
        alternative_captions(choices, "x", label=label, sample_id="s7")
    assert message in str(err.value)


def test_alternatives_are_laid_out_per_row_with_padded_slots(tokenizer):
    rows = [CHOICES[:2], [], CHOICES[1:4]]
    tokens = tokenize_alternatives(tokenizer, rows, max_seq_length=16)
    ids, mask = tokens[HARD_NEGATIVE_INPUT_IDS], tokens[HARD_NEGATIVE_ATTENTION_MASK]
    assert ids.shape[:2] == mask.shape[:2] == (3, 3)
    assert mask.any(dim=-1).tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    for row, texts in enumerate(rows):
        for slot, text in enumerate(texts):
            length = int(mask[row, slot].sum())
            assert ids[row, slot, :length].tolist() == tokenizer(text)["input_ids"]
    assert (ids[1] == tokenizer.pad_token_id).all()


def test_the_collator_adds_hard_negatives_only_when_asked(tokenizer):
    records = [
        Record(f"s{i}", jpeg_bytes(40, 30, seed=i), CHOICES[i], {"caption_choices": CHOICES, "label": "ABCD"[i]})
        for i in range(4)
    ]
    dataset = ImageTextDataset(records, FastImageTransform(32))  # type: ignore[arg-type]
    samples = [dataset[i] for i in range(4)]
    plain = ImageTextCollator(tokenizer, 16)(samples)
    assert HARD_NEGATIVE_INPUT_IDS not in plain
    batch = ImageTextCollator(tokenizer, 16, hard_negative_column="caption_choices")(samples)
    ids, mask = batch[HARD_NEGATIVE_INPUT_IDS], batch[HARD_NEGATIVE_ATTENTION_MASK]
    assert ids.shape[:2] == (4, 3) and mask.any(dim=-1).all()
    own_caption = plain["input_ids"][2][plain["attention_mask"][2].bool()].tolist()
    row = [ids[2, slot][mask[2, slot].bool()].tolist() for slot in range(3)]
    assert own_caption not in row and len(row) == 3  # the sample's own caption is never its negative
    # Selecting rows (device-stage bad samples) keeps each row's negatives with it.
    assert batch.select([2])[HARD_NEGATIVE_INPUT_IDS].equal(ids[2:3])
