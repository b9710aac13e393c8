"""What a training run prints on stdout: progress logs while it trains, its metrics once, as one table."""

from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from vlfit.cli import main
from vlfit.training.trainer import _Printer, _ProgressBar

SUMMARY = {"train_runtime": 9.8, "train_samples_per_second": 0.8, "train_loss": 1.5, "epoch": 0.25}
STEP = {"loss": 1.5, "learning_rate": 3e-5}
EVALUATION = {"eval_t2i_recall@1": 0.5, "eval_runtime": 1.0}


@pytest.mark.parametrize("callback_class", [_ProgressBar, _Printer])
def test_the_console_shows_steps_and_evaluations_while_training_but_not_what_the_run_prints_as_a_table(
    callback_class, capsys
):
    args = SimpleNamespace(disable_tqdm=True)
    state, control = TrainerState(max_steps=4), TrainerControl()
    callback = callback_class()
    callback.on_train_begin(args, state, control)
    for logs in (STEP, EVALUATION, SUMMARY):
        callback.on_log(args, state, control, logs=dict(logs))
    callback.on_train_end(args, state, control)
    callback.on_log(args, state, control, logs=dict(EVALUATION))  # trainer.evaluate() after training
    out = capsys.readouterr().out
    assert "'loss'" in out and out.count("eval_t2i_recall@1") == 1
    assert "train_runtime" not in out


@pytest.mark.slow
def test_a_run_prints_its_metrics_once_and_no_blank_lines(tmp_path, synthetic_dataset_dir, capfd):
    assert main(["train", "--model_preset", "tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                 str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to",
                 "none", "--save_strategy", "no"]) == 0  # fmt: skip
    out = capfd.readouterr().out
    assert out.count("train_runtime") == 1 and "***** train metrics *****" in out
    assert "" not in out.splitlines()  # the preset's tokenizer training printed three blank lines
