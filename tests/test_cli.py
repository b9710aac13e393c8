"""End to end through the real CLI: make-data -> train (tiny preset) -> eval, on a synthetic dataset."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from vlfit.cli import main
from vlfit.commands import evaluate, train
from vlfit.commands.train import parse_arguments
from vlfit.training import run as training_run


@pytest.mark.slow
def test_make_data_train_eval_end_to_end(tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["make-data", "--output_dir", str(data), "--num_samples", "60", "--min_long_side", "200",
                 "--max_long_side", "400", "--num_proc", "1"]) == 0  # fmt: skip
    out = tmp_path / "model"
    common = ["--dataset_name", str(data), "--report_to", "none", "--per_device_eval_batch_size", "16"]
    assert main(["train", "--model_preset", "tiny", "--output_dir", str(out), "--max_steps", "10",
                 "--per_device_train_batch_size", "8", "--logging_steps", "5", "--dataloader_num_workers", "1",
                 "--save_strategy", "no", "--do_eval", *common]) == 0  # fmt: skip

    state = json.loads((out / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == [5, 10]
    for entry in logged:
        assert entry["samples_per_second"] > 0
        assert 0.0 <= entry["data_wait_share"] <= 1.0
    eval_results = json.loads((out / "eval_results.json").read_text())
    assert eval_results["eval_num_samples"] == 6  # the validation split of 60 samples
    assert 0.0 <= eval_results["eval_t2i_recall@1"] <= 1.0
    assert eval_results["eval_chance_recall@1"] == pytest.approx(1 / 6)
    assert "eval_matching_accuracy" in eval_results
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (out / name).exists(), name

    capsys.readouterr()
    assert main(["eval", "--model_name_or_path", str(out), "--eval_split", "test", "--eval_pool_size", "3",
                 *common]) == 0  # fmt: skip
    test_results = json.loads((out / "eval_results.json").read_text())
    assert test_results["eval_num_samples"] == 6  # the test split
    assert test_results["eval_pool_size"] == 3
    assert test_results["eval_chance_recall@1"] == pytest.approx(1 / 3)


@pytest.mark.slow
def test_train_from_a_json_file_of_flags(tmp_path, synthetic_dataset_dir):
    out = tmp_path / "model"
    flags = {
        "model_preset": "tiny",
        "dataset_name": synthetic_dataset_dir,
        "output_dir": str(out),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "report_to": "none",
        "save_strategy": "no",
        "image_pipeline": "reference",
    }
    config = tmp_path / "flags.json"
    config.write_text(json.dumps(flags))
    assert main(["train", str(config)]) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2


def test_unknown_command_lists_the_commands(capsys):
    assert main(["fly"]) == 2
    err = capsys.readouterr().err
    assert "'fly'" in err and "make-data" in err and "train" in err


def _error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--caption_column", "caption_text"],
            r"caption column 'caption_text' not found; available columns: .*image_description",
        ),
        (["--dataset_name", "/no/such/folder"], r"/no/such/folder"),
        (
            ["--model_preset", "medium"],
            r"unknown --model_preset 'medium'; choose one of: tiny, small, small-p8, base, large",
        ),
        (["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size 0 is out of range: give at least 1"),
        (
            ["--hard_negative_column", "choices"],
            r"--hard_negative_column 'choices' is not a column of the training split; it has: .*caption_choices",
        ),
    ],
    ids=["missing-column", "missing-path", "unknown-preset", "batch-size-0", "missing-hard-negative-column"],
)
def test_user_mistakes_end_in_one_error_line_and_exit_code_2(tmp_path, synthetic_dataset_dir, capsys, flags, named):
    base = ["--dataset_name", synthetic_dataset_dir, "--model_preset", "tiny", "--output_dir", str(tmp_path / "o"),
            "--report_to", "none", "--max_steps", "1"]  # fmt: skip
    capsys.readouterr()
    assert main(["train", *base, *flags]) == 2  # of a flag given twice, the later wins
    lines = _error_lines(capsys)
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"vlfit train: error: .*{named}.*", lines[0]), lines[0]


def test_debug_anywhere_keeps_the_traceback(tmp_path):
    argv = ["--model_preset", "medium", "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="unknown --model_preset 'medium'"):
        main(["--debug", "train", *argv])
    with pytest.raises(ValueError, match="unknown --model_preset 'medium'"):
        main(["train", *argv[:2], "--debug", *argv[2:]])


def test_enable_jit_checkpoint_is_refused(tmp_path, capsys):
    # transformers' own SIGTERM checkpointing would be replaced by vlfit's without a word: say so instead.
    capsys.readouterr()
    assert main(["train", "--model_preset", "tiny", "--output_dir", str(tmp_path), "--enable_jit_checkpoint"]) == 2
    assert _error_lines(capsys) == [
        "vlfit train: error: --enable_jit_checkpoint is not needed: vlfit already saves a checkpoint when SIGTERM "
        "or SIGINT arrives and resumes from it when the same command is run again; drop the flag"
    ]


def test_unknown_pipeline_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model_preset", "tiny", "--output_dir", str(tmp_path), "--image_pipeline", "turbo"])
    assert stop.value.code == 2
    assert "invalid choice: 'turbo'" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_runs_the_cli():
    # torchrun and accelerate launch start `python -m vlfit ...`.
    done = subprocess.run([sys.executable, "-m", "vlfit", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "make-data" in done.stdout and "eval" in done.stdout


@pytest.mark.slow
def test_demo_runs_end_to_end_and_a_rerun_says_it_is_complete(tmp_path, capsys):
    argv = ["demo", "--output_dir", str(tmp_path), "--num_samples", "40", "--model_preset", "tiny",
            "--num_train_epochs", "1", "--per_device_train_batch_size", "8", "--eval_pool_size", "4",
            "--dataloader_num_workers", "0", "--hard_negatives", "true"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "generating 40 synthetic samples" in out
    assert "text->image recall@1" in out and "(chance 0.250, pool of 4)" in out
    assert "training throughput" in out and " 0.0 samples/s" not in out
    assert "pipeline, hard negatives" in out  # the demo trains against its captions' one-attribute edits
    assert main(argv) == 0
    again = capsys.readouterr().out  # a finished demo is not trained again (tests/test_demo.py: an unfinished one is)
    assert f"the demo in {tmp_path} is complete, nothing trained" in again and "generating" not in again


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_flags_file_accepts_auto_workers(tmp_path, suffix):
    flags = {"model_preset": "tiny", "output_dir": str(tmp_path / "o"), "dataloader_num_workers": "auto"}
    path = tmp_path / f"flags{suffix}"
    path.write_text(json.dumps(flags) if suffix == ".json" else yaml.safe_dump(flags))
    args = parse_arguments([str(path)], allow_auto_workers=True)
    assert args.auto_workers and args.training.dataloader_num_workers == 0  # parsed as 0; the probe sets the count
    assert args.model.model_preset == "tiny"
    path.write_text(json.dumps({**flags, "dataloader_num_workers": 3}) if suffix == ".json" else "- not a mapping")
    if suffix == ".json":
        args = parse_arguments([str(path)], allow_auto_workers=True)
        assert args.auto_workers is False and args.training.dataloader_num_workers == 3
    else:
        with pytest.raises(ValueError, match="expected a mapping"):
            parse_arguments([str(path)], allow_auto_workers=True)


def test_command_line_auto_workers_and_eval_flags_file(tmp_path):
    argv = ["--model_preset", "tiny", "--output_dir", str(tmp_path), "--dataloader_num_workers", "auto"]
    assert parse_arguments(argv, allow_auto_workers=True).auto_workers is True
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump({"model_preset": "tiny", "output_dir": str(tmp_path), "eval_split": "test"}))
    assert parse_arguments([str(path)], prog="vlfit eval").data.eval_split == "test"


def test_broken_flags_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "flags.yaml"
    path.write_text("model_preset: [tiny\n")
    capsys.readouterr()
    assert main(["train", str(path)]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"vlfit train: error: {path}: not valid YAML:")


@pytest.fixture
def recorded_runs(monkeypatch, tmp_path) -> list:
    """Replace training/evaluation by a recorder of the arguments each command passes to run(); ``tmp_path/model``
    is a model folder (a config, as the flag index checks before the command runs)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    runs: list = []

    def fake_run(model_args, data_args, training_args, setup=None, command_line=None):
        runs.append((model_args, data_args, training_args))
        return {}

    monkeypatch.setattr(training_run, "run", fake_run)  # vlfit eval imports it when it runs
    monkeypatch.setattr(train, "run", fake_run)
    monkeypatch.setattr(train, "setup_run", lambda *args: None)  # no data opened: only the arguments are recorded
    monkeypatch.setattr(training_run, "setup_run", lambda *args: SimpleNamespace(spec=None, task="retrieval"))  # eval's
    return runs


@pytest.mark.parametrize("form", ["flag", "equals", "json", "yaml"])
def test_eval_keeps_the_output_dir_it_was_given(tmp_path, recorded_runs, form):
    model, out = str(tmp_path / "model"), str(tmp_path / "metrics")
    flags = {"model_name_or_path": model, "output_dir": out, "report_to": "none"}
    if form == "flag":
        argv = ["--model_name_or_path", model, "--output_dir", out]
    elif form == "equals":
        argv = ["--model_name_or_path", model, f"--output_dir={out}"]
    else:
        path = tmp_path / f"flags.{form}"
        path.write_text(json.dumps(flags) if form == "json" else yaml.safe_dump(flags))
        argv = [str(path)]
    assert main(["eval", *argv]) == 0
    assert recorded_runs[-1][2].output_dir == out


def test_eval_writes_into_the_model_folder_without_output_dir(tmp_path, recorded_runs):
    model = str(tmp_path / "model")
    assert main(["eval", "--model_name_or_path", model]) == 0
    assert recorded_runs[-1][2].output_dir == model
    path = tmp_path / "flags.json"
    path.write_text(json.dumps({"model_name_or_path": model}))
    assert main(["eval", str(path)]) == 0
    assert recorded_runs[-1][2].output_dir == model


@pytest.mark.parametrize("command", [train, evaluate])
def test_command_main_without_argv_reads_sys_argv(tmp_path, recorded_runs, monkeypatch, command):
    out = str(tmp_path / "out")
    monkeypatch.setattr(sys, "argv", ["vlfit", "--model_name_or_path", str(tmp_path), "--output_dir", out])
    assert command.main(None) == 0
    assert recorded_runs[-1][2].output_dir == out
    assert recorded_runs[-1][0].model_name_or_path == str(tmp_path)
    path = tmp_path / "flags.yaml"
    out = str(tmp_path / "out-2")
    path.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path), "output_dir": out, "seed": 7}))
    monkeypatch.setattr(sys, "argv", ["vlfit", str(path)])
    assert command.main(None) == 0
    assert recorded_runs[-1][2].seed == 7 and recorded_runs[-1][2].output_dir == out
