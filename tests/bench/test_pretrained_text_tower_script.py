"""``benchmarks/pretrained_text_tower.py`` runs at a tiny size without the all-MiniLM-L6-v2 wheel: a tiny BERT saved
as a pretrained tower is the "pretrained" text tower, and each of the three runs (locked, fine-tuned, random) trains,
evaluates and is recorded with its recall curve and the command that reruns it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.scripts import run_benchmark_script

pytestmark = pytest.mark.slow


def tiny_bert(folder: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir()
    characters = list("abcdefghijklmnopqrstuvwxyz0123456789")
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters, *(f"##{c}" for c in characters)]
    (folder / "vocab.txt").write_text("\n".join(vocabulary) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocabulary), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    return folder


def test_the_text_tower_benchmark_records_three_runs(tmp_path, monkeypatch):
    text = tiny_bert(tmp_path / "bert")
    argv = ["--text_model", str(text), "--steps", "2", "--eval_steps", "1", "--num_samples", "40", "--batch_size",
            "4", "--eval_pool_size", "4", "--out", str(tmp_path / "runs"), "--results", str(tmp_path)]  # fmt: skip
    run_benchmark_script("pretrained_text_tower.py", argv, monkeypatch)
    record = json.loads((tmp_path / "pretrained_text_tower.json").read_text())
    assert [run["run"] for run in record["runs"]] == ["locked", "unlocked", "random"]
    for run in record["runs"]:
        assert [point["step"] for point in run["curve"]] == [1, 2]
        assert 0 <= run["final_t2i_recall@1"] <= 1 and run["steps_to_t2i_recall@1_0.5"] in (None, 1, 2)
    assert record["command"].startswith("python benchmarks/pretrained_text_tower.py --steps 2 --eval_steps 1 ")
