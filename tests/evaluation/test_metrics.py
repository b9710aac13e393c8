import pytest
import torch

from vlfit.data.hard_negatives import label_to_index
from vlfit.inference.recall import matching_accuracy, pooled_recall_at_k, recall_at_k


def test_identity_similarity_is_perfect_recall():
    metrics = recall_at_k(torch.eye(4), ks=(1, 5))
    assert metrics == {"t2i_recall@1": 1.0, "t2i_recall@5": 1.0, "i2t_recall@1": 1.0, "i2t_recall@5": 1.0}


def test_hand_built_matrix_directions_differ():
    # Rows are texts, columns images. Text 0 ranks its image 2nd; image 0 is ranked 1st by its text.
    sim = torch.tensor(
        [
            [0.5, 0.9, 0.1],
            [0.0, 0.8, 0.2],
            [0.0, 0.1, 0.7],
        ]
    )
    m = recall_at_k(sim, ks=(1, 2))
    assert m["t2i_recall@1"] == pytest.approx(2 / 3)  # text 0 fails at k=1
    assert m["t2i_recall@2"] == pytest.approx(1.0)
    # Column 1: image 1 is scored 0.9 by text 0, above its own text (0.8): it fails at k=1.
    assert m["i2t_recall@1"] == pytest.approx(2 / 3)


def test_ties_count_against_the_true_pair():
    m = recall_at_k(torch.ones(5, 5), ks=(1, 4, 5))
    assert m["t2i_recall@1"] == 0.0 and m["t2i_recall@4"] == 0.0 and m["t2i_recall@5"] == 1.0


def test_rejects_non_square():
    with pytest.raises(ValueError, match="square"):
        recall_at_k(torch.zeros(2, 3))


# Three images; texts 0-1 describe image 0, texts 2-4 image 1, text 5 image 2 (rows texts, columns images).
SEVERAL = torch.tensor(
    [
        [0.9, 0.2, 0.1],  # text 0: its image first
        [0.3, 0.6, 0.1],  # text 1: image 1 ahead of its own (2nd)
        [0.1, 0.8, 0.8],  # text 2: tied with image 2, counts against it (2nd)
        [0.0, 0.5, 0.4],  # text 3: first
        [0.7, 0.2, 0.1],  # text 4: image 0 ahead (2nd)
        [0.1, 0.1, 0.3],  # text 5: first
    ]
)
OWNER = torch.tensor([0, 0, 1, 1, 1, 2])


def test_several_captions_per_image_are_scored_as_papers_do():
    m = recall_at_k(SEVERAL, (1, 2, 3), OWNER)
    # Text->image: each caption ranks its image among the 3 images; ranks 0, 1, 1, 0, 1, 0.
    assert m["t2i_recall@1"] == pytest.approx(3 / 6) and m["t2i_recall@2"] == 1.0
    # Image->text: image 0's best caption is text 0 (0.9, first of its column). Image 1's best are texts 2
    # (0.8); nothing else reaches 0.8: first. Image 2's caption (0.3) is behind text 2 (0.8) and text 3 (0.4)
    # of image 1, and tied with no one: rank 2.
    assert m["i2t_recall@1"] == pytest.approx(2 / 3)
    assert m["i2t_recall@2"] == pytest.approx(2 / 3) and m["i2t_recall@3"] == 1.0


def test_an_image_found_through_any_caption_and_ties_between_its_own_captions_do_not_count():
    similarity = torch.tensor([[0.5, 0.0], [0.5, 0.0], [0.5, 0.1]])  # column 0: its two captions tie at 0.5
    m = recall_at_k(similarity, (1,), torch.tensor([0, 0, 1]))
    assert m["i2t_recall@1"] == pytest.approx(1 / 2)  # image 0: the tie with text 2 (not its own) counts
    similarity[2, 0] = 0.4
    assert recall_at_k(similarity, (1,), torch.tensor([0, 0, 1]))["i2t_recall@1"] == 1.0


def test_one_caption_per_image_gives_the_diagonal_figures():
    g = torch.Generator().manual_seed(0)
    similarity = torch.rand(7, 7, generator=g)
    assert recall_at_k(similarity, (1, 3), torch.arange(7)) == recall_at_k(similarity, (1, 3))


def test_pools_hold_whole_images_with_all_their_captions():
    # Texts as one-hot vectors of their image, images one-hot too, image 2 a distractor of text 1 in the full set.
    texts, images = torch.eye(3)[OWNER], torch.eye(3).clone()
    images[2, 0] = 2.0  # image 2 scores 2.0 with every caption of image 0
    full = pooled_recall_at_k(texts, images, None, (1,), OWNER)
    pooled = pooled_recall_at_k(texts, images, 2, (1,), OWNER)  # pools {image 0, 1} + captions, {image 2} + text 5
    assert full["t2i_recall@1"] == pytest.approx(4 / 6) and pooled["t2i_recall@1"] == 1.0
    assert full["num_images"] == pooled["num_images"] == 3 and full["num_texts"] == pooled["num_texts"] == 6
    assert pooled["pool_size"] == 2
    assert pooled["chance_recall@1"] == pytest.approx((5 * (1 / 2) + 1 * 1.0) / 6)
    # Image->text in the pool of image 2 alone: text 5 is its only candidate.
    assert pooled["i2t_recall@1"] == 1.0


def test_pools_restrict_candidates_and_report_chance():
    # 4 pairs; text i matches image i but image 3 also scores high with text 0 (a distractor only in the full set).
    t = torch.eye(4)
    i = torch.eye(4).clone()
    i[3, 0] = 2.0
    full = pooled_recall_at_k(t, i, None, ks=(1,))
    pooled = pooled_recall_at_k(t, i, 2, ks=(1,))
    assert full["t2i_recall@1"] == pytest.approx(3 / 4)
    assert pooled["t2i_recall@1"] == 1.0  # pools {0,1} and {2,3}: image 3 is no longer a candidate for text 0
    assert full["chance_recall@1"] == pytest.approx(1 / 4)
    assert pooled["chance_recall@1"] == pytest.approx(1 / 2)
    assert pooled["pool_size"] == 2 and pooled["num_samples"] == pooled["num_images"] == 4


def test_uneven_last_pool_is_weighted_by_size():
    m = pooled_recall_at_k(torch.eye(5), torch.eye(5), 2, ks=(1,))
    assert m["chance_recall@1"] == pytest.approx((2 * 0.5 + 2 * 0.5 + 1 * 1.0) / 5)


def test_matching_accuracy_on_hand_built_embeddings():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    choices = torch.tensor(
        [
            [[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]],  # best is choice 1
            [[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]],  # best is choice 0
        ]
    )
    assert matching_accuracy(images, choices, torch.tensor([1, 0])) == 1.0
    assert matching_accuracy(images, choices, torch.tensor([1, 2])) == 0.5


@pytest.mark.parametrize(("label", "index"), [("A", 0), ("e", 4), (" C ", 2), (3, 3), ("1", 1)])
def test_label_to_index(label, index):
    assert label_to_index(label) == index


def test_label_to_index_rejects_garbage():
    with pytest.raises(ValueError, match="'Z'"):
        label_to_index("Z")
