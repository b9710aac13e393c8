"""Flags and data that vlfit refuses or warns about instead of silently accepting."""

import logging

import pytest
import torch
from transformers import TrainerCallback

from vlfit.commands.train import parse_arguments
from vlfit.errors import ConfigError, DataError, OutOfMemoryError, out_of_memory_in_one_line
from vlfit.training.run import run, setup_run


def _parse(*flags):
    return parse_arguments(["--model_preset", "tiny", "--output_dir", "/tmp/unused", "--report_to", "none", *flags])


def test_abbreviated_flags_are_unknown_and_the_closest_flag_is_suggested(capsys):
    with pytest.raises(SystemExit) as caught:
        _parse("--learning_rat", "1e-3")
    assert caught.value.code == 2
    assert "unrecognized arguments: --learning_rat (did you mean --learning_rate?)" in capsys.readouterr().err


def test_model_is_an_alias_of_model_name_or_path():
    args = parse_arguments(["--model", "some/folder", "--output_dir", "/tmp/unused"])
    assert args.model.model_name_or_path == "some/folder"


def test_fp16_on_a_cpu_is_refused():
    with pytest.raises(ConfigError, match="--fp16 on a CPU.*--bf16"):
        _parse("--fp16")


def test_a_split_of_one_sample_is_refused(synthetic_dataset_dir):
    args = _parse("--dataset_name", synthetic_dataset_dir, "--do_train", "--max_train_samples", "1")
    with pytest.raises(DataError, match="training split .* has 1 sample: .* at least 2"):
        setup_run(args.model, args.data, args.training)


def test_a_batch_larger_than_the_split_is_used_with_a_warning(synthetic_dataset_dir, caplog):
    args = _parse("--dataset_name", synthetic_dataset_dir, "--do_train", "--max_train_samples", "6",
                  "--per_device_train_batch_size", "48")  # fmt: skip
    caplog.set_level(logging.WARNING, logger="vlfit")
    setup = setup_run(args.model, args.data, args.training)
    assert len(setup.train_source) == 6
    assert "--per_device_train_batch_size 48 is larger than the training split (6 samples)" in caplog.text


def test_version_and_eval_help_list_their_own_flags(capsys):
    from vlfit.cli import main
    from vlfit.version import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vlfit {__version__}"
    assert main(["eval", "--help"]) == 0  # answered from the flag index: what the parser prints (its own test)
    help_text = capsys.readouterr().out
    assert "--eval_pool_size" in help_text and "--per_device_eval_batch_size" in help_text
    assert "--learning_rate" not in help_text and "--lora_r" not in help_text  # training's flags are train's
    assert help_text.index("--model_name_or_path") < help_text.index("--eval_split") < help_text.index("--seed")


def test_model_is_an_alias_in_flags_files_and_keyword_arguments_too(tmp_path):
    from vlfit.commands.evaluate import parse_values

    path = tmp_path / "flags.json"
    path.write_text('{"model": "some/folder", "output_dir": "/tmp/unused"}')
    args = parse_arguments([str(path)])
    assert args.model.model_name_or_path == "some/folder" and "model_name_or_path" in args.given
    assert parse_values({"model": "some/folder"}).training.output_dir == "some/folder"
    with pytest.raises(ConfigError, match="pass --model_name_or_path or --model, not both"):
        parse_values({"model": "a", "model_name_or_path": "b"})


def test_a_missing_local_model_folder_is_said_to_be_missing_not_looked_for_on_the_hub(tmp_path, monkeypatch):
    from vlfit.errors import MissingFileError
    from vlfit.models.loading import resolve_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ("./runs/nothing", "runs/nothing", str(tmp_path / "nothing"), "runs/a/b"):
        with pytest.raises(MissingFileError, match=rf"--model_name_or_path {name}: no such folder"):
            resolve_model(**parse_arguments(["--model", name, "--output_dir", "/tmp/unused"]).model.source_keywords())


class _AllocatesTooMuch(TrainerCallback):
    """Asks torch for a petabyte at the first step, as a batch far too large for the machine would."""

    def on_step_begin(self, *args, **kwargs):
        torch.empty(2**50, dtype=torch.uint8)


def test_running_out_of_memory_at_a_step_names_the_flags_that_set_its_size(tmp_path, synthetic_dataset_dir):
    args = parse_arguments(["--model_preset", "tiny", "--output_dir", str(tmp_path), "--report_to", "none",
                            "--dataset_name", synthetic_dataset_dir, "--do_train", "--max_steps", "1",
                            "--max_train_samples", "4", "--per_device_train_batch_size", "2",
                            "--max_seq_length", "16"])  # fmt: skip
    with pytest.raises(OutOfMemoryError) as refused:
        run(args.model, args.data, args.training, callbacks=[_AllocatesTooMuch()])
    (line,) = str(refused.value).splitlines()
    assert line.startswith("out of memory in a training step (torch: DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 1125899906842624 bytes.")  # fmt: skip
    assert "lower --per_device_train_batch_size (2) or --max_seq_length (16); its images are " in line
    assert line.endswith("px, the model's own size")


def test_an_error_that_is_not_out_of_memory_passes_as_it_is():
    sizes = {"per_device_eval_batch_size": 8, "max_num_patches": 256, "max_seq_length": 64}
    with (
        pytest.raises(RuntimeError, match="^mat1 and mat2 shapes cannot be multiplied"),
        out_of_memory_in_one_line("a step", sizes),
    ):
        torch.ones(2, 3) @ torch.ones(2, 3)
    expected = r"\(torch: MemoryError\): lower --per_device_eval_batch_size \(8\), --max_num_patches \(256\) or "
    with pytest.raises(OutOfMemoryError, match=expected + r"--max_seq_length \(64\)$"):  # noqa: SIM117
        with out_of_memory_in_one_line("an evaluation step", sizes):
            raise MemoryError
