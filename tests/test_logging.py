"""Logging is configured by the CLI entry point only: library modules log to their own loggers, nothing else."""

import logging
import re
from pathlib import Path

import pytest

import vlfit
from vlfit.cli import take_log_level
from vlfit.logs import configure_logging


def test_no_library_module_configures_logging():
    """Only vlfit.logs (called by the CLI's entry point) adds handlers or calls basicConfig; every other module just
    logs to getLogger(__name__)."""
    package = Path(vlfit.__file__).parent
    configuring = re.compile(r"logging\.basicConfig|\.addHandler\(|StreamHandler\(|getLogger\([\"']vlfit")
    offenders = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "logs.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if configuring.search(line)
    ]
    assert offenders == []


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
