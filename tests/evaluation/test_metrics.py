import pytest
import torch

from vlfit.data.hard_negatives import label_to_index
from vlfit.evaluation.metrics import matching_accuracy, pooled_recall_at_k, recall_at_k


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
    assert pooled["pool_size"] == 2 and pooled["num_samples"] == 4


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
