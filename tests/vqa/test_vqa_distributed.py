"""``--task vqa`` under torchrun: two gloo processes train one model, and the distributed evaluation scores every
question once, as ``vlfit eval`` of the saved model in one process does."""

from __future__ import annotations

import json

import pytest

from tests.training.train_runs import run_torchrun
from vlfit.cli import main

pytestmark = pytest.mark.slow

QUESTIONS = 24  # validation questions: not a multiple of 2 processes x eval batch 5, so the last batch is padded


def test_two_processes_train_and_evaluate_each_question_once(tmp_path, capsys):
    from vlfit.commands.make_data import main as make_data

    data = tmp_path / "data"
    make_data(["--task", "vqa", "--output_dir", str(data), "--num_samples", "120", "--validation_fraction",
               str(QUESTIONS / 120), "--test_fraction", "0", "--min_long_side", "64", "--max_long_side", "96",
               "--num_proc", "1"])  # fmt: skip
    out = tmp_path / "run"
    done = run_torchrun("-m", "vlfit", "train", "--task", "vqa", "--model_preset", "tiny", "--dataset_name", str(data),
                        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "4",
                        "--per_device_eval_batch_size", "5", "--do_eval", "--report_to", "none", "--save_strategy",
                        "no", "--disable_tqdm", "true")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    distributed = json.loads((out / "eval_results.json").read_text())
    assert distributed["eval_vqa_questions"] == QUESTIONS

    capsys.readouterr()
    assert main(["eval", "--model_name_or_path", str(out), "--dataset_name", str(data), "--output_dir",
                 str(tmp_path / "eval"), "--per_device_eval_batch_size", "7", "--report_to", "none"]) == 0  # fmt: skip
    single = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    for key in ("eval_vqa_questions", "eval_vqa_accuracy", "eval_vqa_accuracy_majority_answer"):
        assert distributed[key] == pytest.approx(single[key]), key
