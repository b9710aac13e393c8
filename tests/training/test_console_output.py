"""What a training run prints on stdout: one compact line per log while it trains (the Trainer's dict only at
--log_level debug), its metrics once, as one table."""

import re
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from tests.training.train_runs import single_torch_thread, tiny_train_argv
from vlfit.cli import main
from vlfit.efficiency.cpu import cpu_info
from vlfit.logs import configure_logging
from vlfit.training.console_log import ConsolePrinter, ConsoleProgressBar, step_line

SUMMARY = {"train_runtime": 9.8, "train_samples_per_second": 0.8, "train_loss": 1.5, "epoch": 0.25}
STEP = {"loss": 1.5, "learning_rate": 3e-5}
EVALUATION = {"eval_t2i_recall@1": 0.5, "eval_runtime": 1.0}


@pytest.mark.parametrize("callback_class", [ConsoleProgressBar, ConsolePrinter])
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
    assert out.splitlines() == ["step 0/4  loss 1.5000  lr 3.0e-05", "eval at step 0/4  t2i_recall@1 0.500"]


@pytest.mark.slow
def test_a_run_prints_its_metrics_once_and_no_blank_lines(tmp_path, synthetic_dataset_dir, capfd):
    assert main(["train", "--model_preset", "tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                 str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to",
                 "none", "--save_strategy", "no"]) == 0  # fmt: skip
    out = capfd.readouterr().out
    assert out.count("train_runtime") == 1 and "***** train metrics *****" in out
    assert "" not in out.splitlines()  # the preset's tokenizer training printed three blank lines


def test_a_step_line_names_each_figure_briefly():
    state = TrainerState(global_step=20, max_steps=100)
    logs = {"loss": 2.31041, "grad_norm": 1.2345, "learning_rate": 4e-05, "samples_per_second": 412.34,
            "data_wait_share": 0.0163, "bad_samples": 0, "epoch": 0.4}  # fmt: skip
    assert step_line(logs, state) == (
        "step 20/100  loss 2.3104  lr 4.0e-05  grad_norm 1.23  epoch 0.40  samples/s 412.3  data_wait 1.6%"
    )
    assert step_line({**logs, "bad_samples": 3, "itm_loss": 0.6931}, state).endswith("bad_samples 3  itm_loss 0.693")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["info", "debug"])
def test_each_logging_step_prints_one_compact_line_and_the_dict_only_at_debug(
    level, tmp_path, synthetic_dataset_dir, capfd
):
    argv = ["train", *tiny_train_argv(synthetic_dataset_dir, tmp_path / "run", "--save_strategy", "no", steps=2),
            "--log_level", level]  # fmt: skip
    try:
        with single_torch_thread():
            assert main(argv) == 0
    finally:
        configure_logging("info")  # as every other in-process command leaves it
    captured = capfd.readouterr()
    steps = [line for line in captured.out.splitlines() if line.startswith("step ")]
    compact = (
        r"step [12]/2  loss \d+\.\d{4}  lr \d\.\de-\d\d  grad_norm \S+  epoch \d\.\d\d"
        + r"  samples/s \S+  data_wait \S+%"
    )
    assert len(steps) == 2 and all(re.fullmatch(compact, line) for line in steps), steps
    assert "{'loss'" not in captured.out
    assert ("{'loss': " in captured.err) == (level == "debug")
    assert f"CPU: {cpu_info().describe()}" in captured.err + captured.out  # the CPU the figures come from
