"""Hard negatives from the data: each sample's alternative captions, tokenized for the contrastive loss.

In-batch negatives are random captions, which rarely differ from the right one in a single attribute; datasets
built for caption matching carry exactly such near misses per image (the New Yorker ``matching`` config and
``vlfit make-data`` both have ``caption_choices``). With ``--hard_negative_column`` each training image is also
scored against its own alternatives (NegCLIP's recipe), which trains the skill matching accuracy measures.

The batch carries them as two inputs of the loss the forward never sees: ``hard_negative_input_ids`` and
``hard_negative_attention_mask`` (the key names are the model interface's, ``vlfit.models.family``), both
``[B, K, L]`` with K the most alternatives any row has; a row with fewer has all-zero mask rows for the missing
ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlfit.errors import DataError
from vlfit.models.family import HARD_NEGATIVE_ATTENTION_MASK as ATTENTION_MASK
from vlfit.models.family import HARD_NEGATIVE_INPUT_IDS as INPUT_IDS
from vlfit.models.family import tokenize_captions

CHOICE_LETTERS = "ABCDE"


def label_to_index(label: str | int, *, sample_id: str = "?") -> int:
    """``"A".."E"`` (the New Yorker matching labels) or an integer to a choice index.

    Raises:
        DataError: naming the sample, for any other label.
    """
    if isinstance(label, int):
        return label
    text = str(label).strip().upper()
    if len(text) == 1 and text in CHOICE_LETTERS:
        return CHOICE_LETTERS.index(text)
    if text.isdigit():
        return int(text)
    raise DataError(f"sample {sample_id}: label {label!r} is neither a letter A-E nor an index; fix the label column")


def caption_choice(choices: Any, caption: str) -> int | None:
    """The index of the one choice equal to ``caption``; None when none or several are (or there are no choices)."""
    if not isinstance(choices, Sequence) or isinstance(choices, str):
        return None
    same = [i for i, choice in enumerate(choices) if choice == caption]
    return same[0] if len(same) == 1 else None


def right_choice(
    choices: Any, label: Any, caption_index: int | None, *, column: str = "caption_choices", sample_id: str = "?"
) -> int | None:
    """The index of the sample's own caption among its ``choices``, by the rule ``alternative_captions`` keeps: the
    choice ``label`` points to when the data has a label, else ``caption_index`` (``caption_choice``: the one
    choice equal to the caption); None when the sample has nothing to be matched against.

    Raises:
        DataError: naming the sample, for a label that is not a choice index or letter, or points past the choices.
    """
    if not isinstance(choices, Sequence) or isinstance(choices, str) or not choices:
        return None
    if label is None:
        return caption_index
    index = label_to_index(label, sample_id=sample_id)
    if not 0 <= index < len(choices):
        raise DataError(
            f"sample {sample_id}: label {label!r} does not point into its {len(choices)} {column!r} entries"
        )
    return index


def alternative_captions(
    choices: Any, caption: str, *, label: Any = None, column: str = "caption_choices", sample_id: str = "?"
) -> list[str]:
    """The captions of ``choices`` that are not the sample's own.

    The sample's own choice is the one ``label`` points to when the data has a label (the New Yorker matching
    config, whose captions are in another column than its choices), else every choice equal to ``caption``.

    Args:
        choices: The column's value: a list of strings, or ``None`` (no alternatives for this sample).
        caption: The sample's caption.
        label: The index or letter of the right choice, or ``None``.
        column: The column's name, for error messages.
        sample_id: The sample's id, for error messages.

    Raises:
        ValueError: ``choices`` is not a list of strings, or ``label`` does not point into it.
    """
    if choices is None:
        return []
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not all(isinstance(c, str) for c in choices):
        raise DataError(
            f"sample {sample_id}: --hard_negative_column {column!r} must hold a list of caption strings, got "
            f"{type(choices).__name__} {str(choices)[:80]!r}; pass the column of alternative captions, or drop "
            "the flag"
        )
    if label is None:
        return [choice for choice in choices if choice.strip() and choice != caption]
    index = right_choice(choices, label, None, column=column, sample_id=sample_id)
    return [choice for i, choice in enumerate(choices) if i != index and choice.strip()]


def tokenize_alternatives(
    tokenizer: Any, alternatives: Sequence[Sequence[str]], max_seq_length: int
) -> dict[str, torch.Tensor]:
    """Tokenize every row's alternatives in one call and lay them out as ``[B, K, L]`` (see the module doc)."""
    rows = len(alternatives)
    most = max((len(row) for row in alternatives), default=0)
    flat = [text for row in alternatives for text in row]
    if not flat:
        empty = torch.zeros(rows, 0, 1, dtype=torch.long)
        return {INPUT_IDS: empty, ATTENTION_MASK: empty.clone()}
    tokens = tokenize_captions(tokenizer, flat, max_seq_length)
    length = tokens["input_ids"].shape[1]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((rows, most, length), pad_id, dtype=tokens["input_ids"].dtype)
    attention_mask = torch.zeros((rows, most, length), dtype=tokens["attention_mask"].dtype)
    start = 0
    for row, texts in enumerate(alternatives):
        input_ids[row, : len(texts)] = tokens["input_ids"][start : start + len(texts)]
        attention_mask[row, : len(texts)] = tokens["attention_mask"][start : start + len(texts)]
        start += len(texts)
    return {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask}
