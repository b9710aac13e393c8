"""Re-ranking in evaluation: the order changes only within each query's top K, ranks follow the matching scores
there and the cosine below, the pools and multi-caption protocol are those of the cosine recall, the caption choices
are scored by the head, and bad input (K beyond the pool, a model without a matching head) is one line each."""

from __future__ import annotations

import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from vlfit.errors import ConfigError
from vlfit.evaluation.rerank import check_rerank, ranks_of_targets, reranked_keys, reranked_recall
from vlfit.evaluation.retrieval import evaluate_retrieval
from vlfit.inference.recall import pooled_recall_at_k
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.itm import BridgeTowerForContrastiveLearningWithITM
from vlfit.models.registry import preset_config
from vlfit.models.tokenizer import train_caption_tokenizer


def rerank_order(in_top: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Each query's candidates in re-ranked order ``[Q, N]`` (``reranked_keys``' keys, descending): the order the
    ranks ``ranks_of_targets`` counts are checked against."""
    by_value = value.argsort(dim=1, descending=True, stable=True)
    return by_value.gather(1, in_top.gather(1, by_value).int().argsort(dim=1, descending=True, stable=True))


def test_reranking_changes_the_order_only_within_the_top_k():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 20, generator=generator)
    matching = torch.randn(5, 20, generator=generator)
    in_top, value = reranked_keys(scores, 6, lambda q, c: matching[q, c])
    order = rerank_order(in_top, value)
    cosine = scores.argsort(dim=1, descending=True)
    assert torch.equal(order[:, 6:], cosine[:, 6:])  # below the top K: untouched
    for q in range(5):
        assert set(order[q, :6].tolist()) == set(cosine[q, :6].tolist())  # the same K candidates...
        assert torch.equal(order[q, :6], cosine[q, :6][matching[q, cosine[q, :6]].argsort(descending=True)])  # ...
    # Every candidate's rank in the re-ranked order is what ranks_of_targets counts.
    position = torch.empty_like(order).scatter_(1, order, torch.arange(20).expand(5, 20))
    for candidate in range(20):
        target = torch.zeros(5, 20, dtype=torch.bool)
        target[:, candidate] = True
        assert torch.equal(ranks_of_targets(in_top, value, target), position[:, candidate])


def test_reranked_recall_uses_the_cosine_pools_and_the_multi_caption_protocol():
    generator = torch.Generator().manual_seed(1)
    images = torch.nn.functional.normalize(torch.randn(12, 16, generator=generator), dim=1)
    image_of_text = torch.arange(12).repeat_interleave(2)  # two captions per image
    texts = torch.nn.functional.normalize(images[image_of_text] + torch.randn(24, 16, generator=generator), dim=1)
    cosine = pooled_recall_at_k(texts, images, 5, image_of_text=image_of_text)
    # Re-scoring with the cosine itself changes nothing.
    same = reranked_recall(texts, images, image_of_text, 5, 3, lambda t, i: (texts[t] * images[i]).sum(1))
    for key in ("t2i_recall@1", "t2i_recall@5", "i2t_recall@1", "i2t_recall@5"):
        assert same[key.replace("_recall", "_rerank_recall")] == pytest.approx(cosine[key]), key
    # An oracle head puts the right answer first whenever it is in the top K: recall@1 becomes recall@K.
    oracle = reranked_recall(texts, images, image_of_text, 5, 3, lambda t, i: (image_of_text[t] == i).float())
    pooled_at_3 = pooled_recall_at_k(texts, images, 5, ks=(3,), image_of_text=image_of_text)
    assert oracle["t2i_rerank_recall@1"] == pytest.approx(pooled_at_3["t2i_recall@3"])
    assert oracle["i2t_rerank_recall@1"] == pytest.approx(pooled_at_3["i2t_recall@3"])
    assert oracle["rerank_top_k"] == 3


def test_bad_rerank_requests_are_one_line_each():
    texts = torch.eye(4)
    with pytest.raises(ConfigError, match=r"^--rerank_top_k 5 is larger than the pool of 4 images"):
        reranked_recall(texts, texts, torch.arange(4), None, 5, lambda t, i: torch.zeros(len(t)))
    with pytest.raises(ConfigError, match=r"^--rerank_top_k 3: the model has no image-text matching head"):
        check_rerank(BridgeTowerForContrastiveLearning(preset_config("tiny")), 3)
    with pytest.raises(ConfigError, match=r"^--rerank_top_k 20 is larger than --eval_pool_size 10"):
        check_rerank(BridgeTowerForContrastiveLearningWithITM(preset_config("tiny")), 20, 10)
    with pytest.raises(ConfigError, match="at least 1"):
        check_rerank(BridgeTowerForContrastiveLearningWithITM(preset_config("tiny")), 0)


class _Batch(dict):
    """What ``embed_split`` reads of a pipeline batch."""

    def __init__(self, rows: dict, positions: list[int], columns: dict) -> None:
        super().__init__(rows)
        self.positions, self.columns, self.bad_samples, self.inputs = positions, columns, [], rows
        self.sample_ids = [f"s{position}" for position in positions]

    def __len__(self) -> int:
        return len(self.positions)


def test_evaluation_reports_reranked_recall_and_itm_matching_beside_cosine():
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearningWithITM(preset_config("tiny")).eval()
    tokenizer = train_caption_tokenizer(["a red circle", "two blue squares", "one green triangle"] * 2, vocab_size=300)
    captions = ["a red circle", "two blue squares", "one green triangle", "a blue circle", "red squares", "green"]
    batches = []
    for start in (0, 3):
        chunk = captions[start : start + 3]
        tokens = tokenizer(chunk, padding="longest", return_tensors="pt")
        rows = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                "pixel_values": torch.randn(3, 3, 64, 64)}  # fmt: skip
        choices = [[caption, "green", "blue"] for caption in chunk]
        batches.append(_Batch(rows, list(range(start, start + 3)), {"caption_choices": choices, "label": [0, 0, 0]}))
    metrics, _ = evaluate_retrieval(BridgeTowerFamily(), model, batches, tokenizer=tokenizer, max_seq_length=16,
                                    device=torch.device("cpu"), pool_size=3, rerank_top_k=2)  # fmt: skip
    for key in ("t2i_recall@1", "t2i_rerank_recall@1", "i2t_rerank_recall@1", "matching_accuracy",
                "matching_accuracy_itm"):  # fmt: skip
        assert 0.0 <= metrics[key] <= 1.0, key
    assert metrics["rerank_top_k"] == 2 and metrics["pool_size"] == 3
    # Re-ranking the top 3 of pools of 3 reorders everything; recall@3 (@5, @10) cannot change.
    assert metrics["t2i_rerank_recall@5"] == metrics["t2i_recall@5"] == 1.0


@pytest.mark.slow
def test_vlfit_eval_refuses_reranking_without_a_matching_head_in_one_line(tiny_checkpoint, synthetic_dataset_dir,
                                                                           tmp_path, capsys):  # fmt: skip
    from vlfit import cli

    argv = ["eval", "--model_name_or_path", str(tiny_checkpoint), "--dataset_name", synthetic_dataset_dir,
            "--eval_split", "test", "--rerank_top_k", "3", "--output_dir", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == cli.USAGE_ERROR_EXIT_CODE
    err = capsys.readouterr().err.strip()  # progress bars of the weights' loading come before it
    assert "Traceback" not in err and "--rerank_top_k 3: the model has no image-text matching head" in err
    assert err.splitlines()[-1].startswith("vlfit eval: error: --rerank_top_k 3")
