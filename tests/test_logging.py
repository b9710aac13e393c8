"""Logging is configured by the CLI entry point only: library modules log to their own loggers, nothing else."""

import logging
import subprocess
import sys

import pytest

from vlfit.cli import take_log_level
from vlfit.logs import configure_logging


def test_importing_and_using_the_library_configures_no_logging():
    code = (
        "import logging, vlfit, vlfit.training.run, vlfit.inference.index, vlfit.commands.train\n"
        "assert not logging.getLogger().handlers, logging.getLogger().handlers\n"
        "assert not logging.getLogger('vlfit').handlers\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_cli_takes_log_level_anywhere_and_refuses_an_unknown_one(capsys):
    assert take_log_level(["--output_dir", "x", "--log_level", "warning"]) == (["--output_dir", "x"], "warning")
    assert take_log_level(["--log_level=debug", "a"]) == (["a"], "debug")
    assert take_log_level(["a"]) == (["a"], "info")
    with pytest.raises(SystemExit):
        take_log_level(["--log_level", "loud"])
    assert "--log_level 'loud'" in capsys.readouterr().err


def test_configure_logging_installs_one_handler_on_vlfit_at_the_level():
    package = logging.getLogger("vlfit")
    before = list(package.handlers)
    try:
        configure_logging("warning")
        configure_logging("debug")
        added = [h for h in package.handlers if h not in before]
        assert len(added) == 1 and package.level == logging.DEBUG
    finally:
        for handler in package.handlers[:]:
            if handler not in before:
                package.removeHandler(handler)
        package.setLevel(logging.NOTSET)
