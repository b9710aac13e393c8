"""``--task vqa`` on a streamed training split: the answers come from ``--answer_vocabulary``, the annotators'
answers travel with each streamed row to the loss, and evaluation reads its split map-style."""

from __future__ import annotations

import json

import pytest

from tests.training.train_runs import logged_losses
from vlfit.cli import main

pytestmark = pytest.mark.slow


def test_a_streamed_split_trains_on_the_answers_of_the_vocabulary_file(tmp_path):
    from vlfit.commands.make_data import main as make_data

    data = tmp_path / "data"
    make_data(["--task", "vqa", "--output_dir", str(data), "--num_samples", "60", "--min_long_side", "64",
               "--max_long_side", "96", "--num_proc", "1", "--format", "parquet"])  # fmt: skip
    vocabulary = tmp_path / "answers.txt"
    vocabulary.write_text("Yes\nno\n2\n3\nred\n")
    out = tmp_path / "run"
    assert main(["train", "--task", "vqa", "--model_preset", "tiny", "--streaming", "--train_file",
                 str(data / "train.parquet"), "--validation_file", str(data / "validation.parquet"),
                 "--answer_vocabulary", str(vocabulary), "--max_steps", "3", "--per_device_train_batch_size", "4",
                 "--logging_steps", "1", "--do_train", "--do_eval", "--output_dir", str(out), "--report_to", "none",
                 "--disable_tqdm", "true"]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert [config["id2label"][str(i)] for i in range(5)] == ["yes", "no", "2", "3", "red"]
    losses = logged_losses(out)
    assert sorted(losses) == [1, 2, 3] and all(loss > 0 for loss in losses.values())
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_vqa_questions"] == 6
