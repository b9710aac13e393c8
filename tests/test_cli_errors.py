"""vlfit's CLI: a UserError is one error line and exit 2; anything else is a bug and keeps its traceback."""

import sys

import pytest
from torch._utils import ExceptionWrapper

from vlfit import cli
from vlfit.cli import error_line, take_debug_flag
from vlfit.data.bad_samples import BadSampleError
from vlfit.errors import (
    ConfigError,
    DataError,
    MissingExtraError,
    MissingFileError,
    ModelLoadError,
    UserError,
    python_api,
    register_option_names,
)
from vlfit.training.bad_sample_ledger import TooManyBadSamplesError


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("--lora_r must be at least 1, got 0"),
        DataError("caption column 'x' not found"),
        MissingFileError("--images /x: no such folder"),
        ModelLoadError("/x: cannot load a model config"),
        BadSampleError("bad sample 3: cannot decode"),
        TooManyBadSamplesError("5 of the 100 samples read were bad"),
        MissingExtraError("vlfit export", "export", "onnxruntime"),
    ],
)
def test_a_user_error_ends_in_one_line_and_exit_2(monkeypatch, capsys, error):
    from vlfit.commands import train

    def failing_main(argv):
        raise error

    monkeypatch.setattr(train, "main", failing_main)
    assert cli.main(["train"]) == cli.USAGE_ERROR_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlfit train: error: ") and "\n" not in err
    assert isinstance(error, UserError)


@pytest.mark.parametrize(
    "error", [ValueError("operands could not be broadcast"), FileNotFoundError(2, "x"), KeyError("k")]
)
def test_anything_else_keeps_its_traceback(monkeypatch, capsys, error):
    from vlfit.commands import train

    def broken_main(argv):
        raise error

    monkeypatch.setattr(train, "main", broken_main)
    with pytest.raises(type(error)):
        cli.main(["train"])
    assert "error:" not in capsys.readouterr().err


def test_python_callers_get_options_as_keywords_and_command_lines_stay():
    register_option_names(["lora_r"])

    @python_api(flags=True)  # takes a command's flags as keywords, as vlfit.train does
    def api_function(**flags):
        raise ConfigError("--lora_r must be at least 1; launch with torchrun --nproc_per_node 2")

    with pytest.raises(ConfigError) as caught:
        api_function()
    assert str(caught.value) == "`lora_r=` must be at least 1; launch with torchrun --nproc_per_node 2"


def test_a_user_error_keeps_its_type_when_a_dataloader_worker_reraises_it():
    try:
        raise DataError("sample 7: no caption")
    except DataError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(DataError):
        wrapper.reraise()


def test_error_line_of_an_exception_reraised_from_a_dataloader_worker():
    try:
        raise BadSampleError.for_sample("t-7", "cannot decode JPEG", "pass --bad_sample_policy skip")
    except BadSampleError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(BadSampleError) as caught:
        wrapper.reraise()
    assert "Original Traceback" in str(caught.value)  # torch's message holds the worker's traceback
    assert error_line(caught.value) == "bad sample t-7: cannot decode JPEG. pass --bad_sample_policy skip"


def test_error_line_joins_a_message_of_several_lines():
    assert error_line(ValueError("first\n  second\n")) == "first second"
    assert error_line(FileNotFoundError(2, "No such file or directory", "/x")) == (
        "[Errno 2] No such file or directory: '/x'"
    )
    assert error_line(ValueError()) == "ValueError"


@pytest.mark.parametrize(
    ("argv", "kept", "debug"),
    [
        (["--debug", "train", "--max_steps", "1"], ["train", "--max_steps", "1"], True),
        (["train", "--max_steps", "1", "--debug"], ["train", "--max_steps", "1"], True),
        (["train", "--debug", "--max_steps", "1"], ["train", "--max_steps", "1"], True),
        (["train", "--max_steps", "1"], ["train", "--max_steps", "1"], False),
        # TrainingArguments' own --debug takes a value: left for it.
        (["train", "--debug", "underflow_overflow"], ["train", "--debug", "underflow_overflow"], False),
        (
            ["train", "--debug", "underflow_overflow tpu_metrics_debug"],
            ["train", "--debug", "underflow_overflow tpu_metrics_debug"],
            False,
        ),
        (["--debug", "train", "--debug", "underflow_overflow"], ["train", "--debug", "underflow_overflow"], True),
        (["train", "--debug", "somefile.json"], ["train", "somefile.json"], True),
    ],
)
def test_take_debug_flag(argv, kept, debug):
    assert take_debug_flag(argv) == (kept, debug)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "--learning_rat", "1e-3"], "unrecognized arguments: --learning_rat (did you mean --learning_rate?)"),
        (["train", "--max_steps", "ten"], "invalid int value: 'ten'"),
        (["eval", "--eval_split", "test", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
@pytest.mark.parametrize("from_index", [True, False], ids=["recorded-flags", "the-parser"])
def test_a_bad_flag_is_one_line_pointing_at_help_without_the_usage(capsys, argv, named, from_index):
    try:  # the recorded flags answer an unknown one with a return; the parser exits as argparse does
        code = cli.main(argv, answer_from_index=from_index)
    except SystemExit as stop:
        code = stop.code
    assert code == cli.USAGE_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"vlfit {argv[0]}: error: ") and named in err
    assert err.endswith(f"; see vlfit {argv[0]} --help\n")
