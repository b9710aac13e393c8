"""Chunked top-k and the ranks of right answers equal what the full similarity matrix gives."""

import pytest
import torch

from vlfit.inference.recall import pooled_recall_at_k, recall_at_k
from vlfit.inference.topk import best_owned_ranks, chunked_topk, target_ranks


def _normalized(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)


@pytest.mark.parametrize("chunk_elements", [1, 7, 64, 1000, 1 << 24])
def test_chunked_topk_equals_the_full_matrix_topk(chunk_elements):
    queries, index = _normalized(13, 16, 0), _normalized(101, 16, 1)
    scores, indices = chunked_topk(queries, index, 10, chunk_elements=chunk_elements)
    full_scores, full_indices = torch.topk(queries @ index.t(), 10, dim=1)
    assert torch.equal(indices, full_indices)
    torch.testing.assert_close(scores, full_scores, rtol=0, atol=1e-6)


def test_chunked_topk_breaks_ties_by_index_and_caps_k_at_the_index_size():
    index = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    scores, indices = chunked_topk(torch.tensor([[1.0, 0.0]]), index, 9, chunk_elements=2)
    assert indices.tolist() == [[0, 2, 3, 1]]
    assert scores.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_target_ranks_equal_the_diagonal_ranks_of_the_full_matrix():
    text, image = _normalized(57, 8, 2), _normalized(57, 8, 3)
    similarity = text @ image.t()
    expected = (similarity >= similarity.diagonal().unsqueeze(1)).sum(1) - 1
    for chunk in (1, 57 * 5, 10_000):
        assert torch.equal(target_ranks(text, image, chunk_elements=chunk), expected)


def test_grouped_ranks_in_chunks_equal_the_full_matrix_recall():
    # 23 images with 1-4 captions each, captions in shuffled order, and exact ties between images.
    g = torch.Generator().manual_seed(7)
    image_of_text = torch.repeat_interleave(torch.arange(23), torch.randint(1, 5, (23,), generator=g))
    image_of_text = image_of_text[torch.randperm(len(image_of_text), generator=g)]
    image = _normalized(23, 8, 8)
    image[5] = image[4]
    text = torch.nn.functional.normalize(image[image_of_text] + 0.9 * _normalized(len(image_of_text), 8, 9), dim=1)
    full = recall_at_k(text @ image.t(), (1, 5, 10), image_of_text)
    for chunk in (1, 31, 10_000):
        pooled = pooled_recall_at_k(text, image, None, (1, 5, 10), image_of_text, chunk_elements=chunk)
        assert {key: pooled[key] for key in full} == full
    assert best_owned_ranks(image, text, image_of_text, chunk_elements=5).shape == (23,)
    with pytest.raises(ValueError, match="each query at least one"):
        best_owned_ranks(image, text[image_of_text != 3], image_of_text[image_of_text != 3])


def test_chunked_recall_gives_the_full_matrix_recall_with_ties_and_pools():
    text, image = _normalized(40, 8, 4), _normalized(40, 8, 5)
    image[10:20] = image[0]  # ties count against the true pair in both
    text[30:] = image[30:]  # and some perfect matches
    full = recall_at_k(text @ image.t(), ks=(1, 5, 10))
    for chunk in (33, 50):
        pooled = pooled_recall_at_k(text, image, None, ks=(1, 5, 10), chunk_elements=chunk)
        assert {key: pooled[key] for key in full} == full
