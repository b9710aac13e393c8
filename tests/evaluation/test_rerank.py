"""Re-ranking in evaluation: the order changes only within each query's top K, ranks follow the matching scores
there and the cosine below, the pools and multi-caption protocol are those of the cosine recall, the caption choices
are scored by the head, and bad input (K beyond the pool, a model without a matching head) is one line each."""

from __future__ import annotations

import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from vlfit.errors import ConfigError
from vlfit.evaluation.rerank import Candidates, check_rerank, rerank_candidates, rerank_table, reranked_recall
from vlfit.evaluation.retrieval import evaluate_retrieval
from vlfit.inference.recall import pooled_recall_at_k
from vlfit.inference.rerank_score import FUSED, SWEPT_WEIGHTS, RerankScore
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.itm import BridgeTowerForContrastiveLearningWithITM
from vlfit.models.registry import preset_config
from vlfit.models.tokenizer import train_caption_tokenizer


def _split(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Texts ``[24, 16]`` near their images ``[12, 16]`` (two captions per image), and each text's image."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.nn.functional.normalize(torch.randn(12, 16, generator=generator), dim=1)
    image_of_text = torch.arange(12).repeat_interleave(2)
    texts = torch.nn.functional.normalize(images[image_of_text] + torch.randn(24, 16, generator=generator), dim=1)
    return texts, images, image_of_text


def test_reranked_ranks_follow_the_matching_scores_within_the_top_k_and_the_cosine_below():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 20, generator=generator)
    matching = torch.randn(5, 20, generator=generator)
    candidates = Candidates.of(scores, torch.eye(20, dtype=torch.bool)[:5], 20, lambda q, c: matching[q, c])
    cosine = scores.argsort(dim=1, descending=True)
    for top_k in (1, 6, 20):
        ranks = []
        for q in range(5):  # the re-ranked list, built by hand: top K by matching score, then the cosine order
            head = cosine[q, :top_k][matching[q, cosine[q, :top_k]].argsort(descending=True)]
            order = torch.cat([head, cosine[q, top_k:]]).tolist()
            ranks.append(order.index(q))  # the right answer of query q is candidate q
        assert candidates.ranks(top_k).tolist() == ranks, top_k


def test_reranked_recall_uses_the_cosine_pools_and_the_multi_caption_protocol():
    texts, images, image_of_text = _split()
    cosine = pooled_recall_at_k(texts, images, 5, image_of_text=image_of_text)
    # Re-scoring with the cosine itself changes nothing.
    same = rerank_candidates(texts, images, image_of_text, 5, 3, lambda t, i: (texts[t] * images[i]).sum(1))
    recall = reranked_recall(same, 3)
    for key in ("t2i_recall@1", "t2i_recall@5", "i2t_recall@1", "i2t_recall@5"):
        assert recall[key.replace("_recall", "_rerank_recall")] == pytest.approx(cosine[key]), key
    # An oracle head puts the right answer first whenever it is in the top K: recall@1 becomes recall@K.
    oracle = rerank_candidates(texts, images, image_of_text, 5, 3, lambda t, i: (image_of_text[t] == i).float())
    recall = reranked_recall(oracle, 3)
    pooled_at_3 = pooled_recall_at_k(texts, images, 5, ks=(3,), image_of_text=image_of_text)
    assert recall["t2i_rerank_recall@1"] == pytest.approx(pooled_at_3["t2i_recall@3"])
    assert recall["i2t_rerank_recall@1"] == pytest.approx(pooled_at_3["i2t_recall@3"])
    assert recall["rerank_top_k"] == 3 and recall["rerank_ms_per_query"] > 0


def test_fused_score_at_weight_zero_is_the_itm_order_and_at_a_large_weight_the_cosine_order():
    texts, images, image_of_text = _split(2)
    noise = torch.Generator().manual_seed(3)
    matching = torch.randn(24, 12, generator=noise)  # a head that disagrees with the cosine
    candidates = rerank_candidates(texts, images, image_of_text, None, 8, lambda t, i: matching[t, i])
    itm_only = candidates.recall(8)
    assert candidates.recall(8, RerankScore(FUSED, 0.0)) == itm_only
    cosine = pooled_recall_at_k(texts, images, None, image_of_text=image_of_text)
    by_cosine = candidates.recall(8, RerankScore(FUSED, 1e6))
    assert by_cosine == {key.replace("_recall", ""): value for key, value in cosine.items() if "recall@" in key
                         and not key.startswith("chance")}  # fmt: skip
    assert itm_only != by_cosine  # the head moved something: the two ends differ
    for way in ("t2i", "i2t"):
        assert (candidates.t2i if way == "t2i" else candidates.i2t).ranks(8, RerankScore(FUSED, 1e6)).tolist() == (
            candidates.t2i if way == "t2i" else candidates.i2t
        ).cosine_rank.tolist()


def test_evaluation_reports_the_k_table_and_a_sweep_picks_the_best_weight():
    texts, images, image_of_text = _split(4)
    # A head that knows the answer but is swamped by noise: the cosine helps it, so a weight above 0 wins.
    noise = torch.randn(24, 12, generator=torch.Generator().manual_seed(5))
    truth = (image_of_text.unsqueeze(1) == torch.arange(12)).float()
    matching = 2 * truth + 3 * noise
    candidates = rerank_candidates(texts, images, image_of_text, None, 8, lambda t, i: matching[t, i])
    weight, tried = candidates.sweep(8)
    best = max(tried.values())
    assert tried[f"{weight:g}"] == best and weight in SWEPT_WEIGHTS
    assert all(value <= best for value in tried.values()) and len(tried) == len(SWEPT_WEIGHTS)
    metrics = reranked_recall(candidates, 8, weight)
    fused_at_1 = (metrics["t2i_fused_recall@1"] + metrics["i2t_fused_recall@1"]) / 2
    assert fused_at_1 == pytest.approx(best, abs=1e-6)
    assert metrics["rerank_weight"] == weight
    for top_k in (4, 8):  # the table's Ks the 8 candidates reach; 16 would need more
        assert {f"t2i_rerank_top{top_k}_recall@1", f"i2t_fused_top{top_k}_recall@5",
                f"rerank_top{top_k}_ms_per_query"} <= set(metrics)  # fmt: skip
    assert "rerank_top16_ms_per_query" not in metrics
    table = rerank_table(metrics)
    assert table[1].startswith("cosine") and any(line.startswith(f"itm+itc {weight:g}, top 8") for line in table)


def test_bad_rerank_requests_are_one_line_each():
    texts = torch.eye(4)
    with pytest.raises(ConfigError, match=r"^--rerank_top_k 5 is larger than the pool of 4 images"):
        rerank_candidates(texts, texts, torch.arange(4), None, 5, lambda t, i: torch.zeros(len(t)))
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
