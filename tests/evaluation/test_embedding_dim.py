"""Tests for vlfit eval --embedding_dim (vlfit.evaluation.embedding_dim): evaluation at a chosen size scores the
full embeddings' first d dimensions, normalized again, as the runtime doors cut them."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from vlfit.commands import evaluate
from vlfit.evaluation import retrieval
from vlfit.evaluation.retrieval import EmbeddedSplit, score_split
from vlfit.inference.embedding_dim import cut
from vlfit.inference.identity import RefusedModelError

SIZE = 8  # of the tiny preset's 64


def _evaluate(model, dataset: str, out, monkeypatch, *flags: str) -> tuple[dict, EmbeddedSplit]:
    """``vlfit eval`` of the training split (64 pairs), its metrics and the embeddings it scored."""
    scored: list[EmbeddedSplit] = []
    monkeypatch.setattr(
        retrieval, "score_split", lambda split, pool=None: scored.append(split) or score_split(split, pool)
    )
    args = evaluate.parse_arguments(["--model_name_or_path", str(model), "--dataset_name", dataset, "--eval_split",
                                     "train", "--output_dir", str(out), "--disable_tqdm", "true", *flags])  # fmt: skip
    return evaluate.evaluate_parsed(args), scored[0]


def test_eval_at_a_size_scores_the_cut_full_embeddings(tiny_checkpoint, synthetic_dataset_dir, tmp_path, monkeypatch,
                                                       caplog) -> None:  # fmt: skip
    full, full_split = _evaluate(tiny_checkpoint, synthetic_dataset_dir, tmp_path / "full", monkeypatch)
    with caplog.at_level(logging.INFO, logger="vlfit.inference.embedding_dim"):
        small, small_split = _evaluate(tiny_checkpoint, synthetic_dataset_dir, tmp_path / "small", monkeypatch,
                                       "--embedding_dim", str(SIZE))  # fmt: skip
    texts, images = cut(torch.cat(full_split.texts), SIZE), cut(torch.cat(full_split.images), SIZE)
    torch.testing.assert_close(torch.cat(small_split.texts), texts, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(small_split.images), images, atol=1e-5, rtol=0)
    choices = torch.cat(full_split.choices)  # [rows, choices, 64]
    choices = cut(choices.flatten(0, 1), SIZE).view(*choices.shape[:2], SIZE)
    at_size = EmbeddedSplit(
        full_split.positions, [texts], [images], full_split.image_keys, [choices], full_split.labels
    )
    expected = score_split(at_size)
    for name in ("t2i_recall@1", "t2i_recall@5", "i2t_recall@1", "matching_accuracy"):
        assert small[f"eval_{name}"] == pytest.approx(expected[name]), name
    assert any(small[f"eval_{k}"] != full[f"eval_{k}"] for k in ("t2i_recall@1", "t2i_recall@5", "i2t_recall@1"))
    assert (full["eval_embedding_dim"], small["eval_embedding_dim"]) == (64, SIZE)
    assert json.loads((tmp_path / "small" / "eval_results.json").read_text())["eval_embedding_dim"] == SIZE
    notes = [r.getMessage() for r in caplog.records if "not trained to stand alone" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith(f"--embedding_dim {SIZE}: ")  # the runtime doors' one line


def test_eval_above_the_embedding_size_is_refused_naming_the_flag(tiny_checkpoint, synthetic_dataset_dir,
                                                                  tmp_path) -> None:  # fmt: skip
    args = evaluate.parse_arguments(["--model_name_or_path", str(tiny_checkpoint), "--dataset_name",
                                     synthetic_dataset_dir, "--output_dir", str(tmp_path), "--embedding_dim", "65",
                                     "--disable_tqdm", "true"])  # fmt: skip
    with pytest.raises(RefusedModelError, match=r"^--embedding_dim 65 is more than the 64 dimensions .* give 1 to 64"):
        evaluate.evaluate_parsed(args)
    assert not (tmp_path / "eval_results.json").exists()
