"""Tests for vlfit.evaluation.retrieval: merging the processes' parts of a split and scoring it."""

from __future__ import annotations

import pytest
import torch

from vlfit.data.image_groups import group_images
from vlfit.evaluation.retrieval import EmbeddedSplit, merge_splits, score_split

DIM, CHOICES = 8, 3


def embeddings(positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic per-position rows, so a row can be traced back to its position after merging."""
    rows = torch.stack([torch.randn(DIM, generator=torch.Generator().manual_seed(p)) for p in positions])
    images = rows + 0.3 * torch.stack(
        [torch.randn(DIM, generator=torch.Generator().manual_seed(1000 + p)) for p in positions]
    )
    choices = torch.stack([torch.stack([rows[i] * (c + 1) for c in range(CHOICES)]) for i in range(len(positions))])
    labels = torch.tensor([p % CHOICES for p in positions])
    return rows, images, choices, labels


def part_of(batches: list[list[int]], bad: list[tuple[str, str]] = (), with_choices: bool = True) -> EmbeddedSplit:
    """What ``embed_split`` gives for these batches of positions."""
    part = EmbeddedSplit(bad_samples=list(bad))
    for batch in batches:
        texts, images, choices, labels = embeddings(batch)
        part.positions.extend(batch)
        part.texts.append(texts)
        part.images.append(images)
        if with_choices:
            part.choices.append(choices)
            part.labels.append(labels)
    if not with_choices:
        part.choices = part.labels = None
    return part


def test_merge_orders_by_position_and_keeps_each_position_once() -> None:
    # Rank 1 pads its last batch with positions 0 and 1 again, as a distributed sampler evens out the batches.
    rank0 = part_of([[0, 1, 3], [6, 7]], bad=[("s2", "corrupt")])
    rank1 = part_of([[4, 5], [0, 1]], bad=[("s2", "corrupt"), ("s8", "empty caption")])
    merged = merge_splits([rank0, rank1])
    assert merged.positions == [0, 1, 3, 4, 5, 6, 7]
    expected = part_of([[0, 1, 3, 4, 5, 6, 7]])
    for field in ("texts", "images", "choices", "labels"):
        assert torch.equal(torch.cat(getattr(merged, field)), torch.cat(getattr(expected, field))), field
    assert merged.bad_samples == [("s2", "corrupt"), ("s8", "empty caption")]


@pytest.mark.parametrize("pool_size", [None, 3])
def test_sharded_scoring_equals_one_process(pool_size: int | None) -> None:
    valid = [p for p in range(23) if p not in (2, 9, 17)]  # three bad rows
    one = score_split(merge_splits([part_of([valid[:8], valid[8:16], valid[16:]])]), pool_size)
    # Batches of 4 rows dealt round-robin to 2 processes, bad rows left out, the last round padded from the start.
    rows = list(range(23)) + [0]
    batches = [[p for p in rows[i : i + 4] if p in valid] for i in range(0, 24, 4)]
    parts = [part_of(batches[0::2]), part_of(batches[1::2])]
    assert score_split(merge_splits(parts), pool_size) == one
    assert one["num_samples"] == len(valid)
    assert "matching_accuracy" in one


def test_choices_are_kept_only_when_every_part_with_samples_has_them() -> None:
    empty = EmbeddedSplit(choices=None, labels=None)  # a process whose every sample was bad
    assert merge_splits([part_of([[0, 1]]), empty]).choices is not None
    merged = merge_splits([part_of([[0, 1]]), part_of([[2, 3]], with_choices=False)])
    assert merged.choices is None and merged.labels is None
    assert "matching_accuracy" not in score_split(merged)


def test_scoring_an_empty_split_says_what_to_check() -> None:
    merged = merge_splits([EmbeddedSplit(bad_samples=[("a", "corrupt")]), EmbeddedSplit()])
    assert merged.bad_samples == [("a", "corrupt")]
    with pytest.raises(ValueError, match="--eval_split"):
        score_split(merged)


def test_captions_of_one_image_are_scored_over_unique_images_after_merging() -> None:
    """COCO-like: 4 images x 4 captions, one row per caption, each caption embedded where its image is. Rows split
    over two processes; every recall is 1 over 4 images and 16 texts (row-by-row pairing would give t2i@1 0)."""
    images = torch.nn.functional.normalize(torch.randn(4, DIM, generator=torch.Generator().manual_seed(0)), dim=1)
    image_of_row = torch.tensor([0, 1, 2, 3] * 4)  # caption k of every image, then caption k + 1
    keys = torch.tensor([101, -7, 55, 3])[image_of_row]
    parts = []
    for rows in ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]):
        part = EmbeddedSplit(choices=None, labels=None)
        part.positions = rows
        part.texts, part.images = [images[image_of_row[rows]]], [images[image_of_row[rows]]]
        part.image_keys = [keys[rows]]
        parts.append(part)
    metrics = score_split(merge_splits(parts))
    assert metrics["num_images"] == 4 and metrics["num_texts"] == metrics["num_samples"] == 16
    assert metrics["t2i_recall@1"] == metrics["i2t_recall@1"] == 1.0
    assert metrics["chance_recall@1"] == pytest.approx(1 / 4)
    pooled = score_split(merge_splits(parts), pool_size=2)  # 2 images and their 8 captions per pool
    assert pooled["pool_size"] == 2 and pooled["chance_recall@1"] == pytest.approx(1 / 2)


def test_unique_images_come_in_order_of_first_appearance() -> None:
    first_rows, image_of_row = group_images(torch.tensor([9, 4, 9, -1, 4]), 5)
    assert first_rows.tolist() == [0, 1, 3] and image_of_row.tolist() == [0, 1, 0, 2, 1]
    first_rows, image_of_row = group_images(None, 3)
    assert first_rows.tolist() == image_of_row.tolist() == [0, 1, 2]
