"""Where vlfit's CLI draws the line between a user mistake (one error line, exit 2) and a bug (a traceback)."""

import importlib
import sys

import pytest
from torch._utils import ExceptionWrapper

from vlfit import cli
from vlfit.cli import DATA_ERROR_TYPES, error_line, is_user_mistake, take_debug_flag
from vlfit.data.bad_samples import BadSampleError
from vlfit.training.bad_sample_ledger import TooManyBadSamplesError


def _raised_in(module: str, exc: BaseException) -> BaseException:
    """``exc`` after being raised by code of ``module``: the innermost frame of its traceback is there."""
    namespace = {"__name__": module, "exc": exc}
    exec("def fail():\n    raise exc\n", namespace)
    try:
        namespace["fail"]()
    except BaseException as err:
        return err
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("module", "exc", "mistake"),
    [
        ("vlfit.data.sources", ValueError("caption column 'x' not found"), True),
        ("transformers.training_args", ValueError("--load_best_model_at_end needs ..."), True),
        ("transformers.hf_argparser", ValueError("Some keys are not used by the HfArgumentParser"), True),
        ("datasets.load", FileNotFoundError("Couldn't find any data file at /x"), True),
        ("torch.serialization", FileNotFoundError(2, "No such file or directory"), True),
        ("anywhere", NotADirectoryError(20, "Not a directory"), True),
        ("transformers.utils.hub", OSError("x is not a local folder and is not a valid model identifier"), True),
        ("torch.nn.functional", ValueError("Expected input batch_size (4) to match target batch_size (3)"), False),
        ("numpy.core", ValueError("operands could not be broadcast together"), False),
        ("vlfit.training.trainer", KeyError("input_ids"), False),
        ("vlfit.training.trainer", TypeError("unsupported operand"), False),
        ("vlfit.models.loading", RuntimeError("CUDA out of memory"), False),
        ("torch.cuda", OSError("libcudart.so: cannot open shared object file"), False),
        ("vlfit.data.dataset", PermissionError(13, "Permission denied"), False),
    ],
)
def test_user_mistake_or_bug(module, exc, mistake):
    assert is_user_mistake(_raised_in(module, exc)) is mistake


def test_data_errors_are_mistakes_wherever_they_are_raised():
    assert is_user_mistake(_raised_in("torch._utils", BadSampleError("bad sample 3: cannot decode")))
    assert is_user_mistake(_raised_in("vlfit.training.trainer", TooManyBadSamplesError("5 of the 100 ...")))


def test_every_declared_data_error_type_exists():
    for module_name, names in DATA_ERROR_TYPES.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert issubclass(getattr(module, name), Exception), f"{module_name}.{name}"


def test_a_data_error_type_is_looked_up_only_once_its_module_is_imported(monkeypatch):
    monkeypatch.setattr(cli, "DATA_ERROR_TYPES", {"vlfit.not_imported_module": ("Anything",)})
    assert "vlfit.not_imported_module" not in sys.modules
    assert not is_user_mistake(_raised_in("torch._utils", RuntimeError("x")))


def test_error_line_of_an_exception_reraised_from_a_dataloader_worker():
    try:
        raise BadSampleError.for_sample("t-7", "cannot decode JPEG", "pass --bad_sample_policy skip")
    except BadSampleError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(BadSampleError) as caught:
        wrapper.reraise()
    assert "Original Traceback" in str(caught.value)  # torch's message holds the worker's traceback
    assert is_user_mistake(caught.value)
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


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    from vlfit.commands import train

    def broken_main(argv):
        raise _raised_in("torch.nn.functional", ValueError("Expected input batch_size (4) to match (3)"))

    monkeypatch.setattr(train, "main", broken_main)
    with pytest.raises(ValueError, match="Expected input batch_size"):
        cli.main(["train"])
    assert "error:" not in capsys.readouterr().err
