"""``vlfit.flags.flag``: a flag's help, choices and aliases reach the parser as ``field(metadata=...)`` did."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from transformers import HfArgumentParser

from vlfit.flags import flag


@dataclass
class _Flags:
    name: str = flag(help="Required: no default.")
    k: int = flag(10, "Results per query.", aliases=["-k"])
    mode: str = flag("quick", "How to check.", choices=("quick", "full"))
    key: str | None = flag(None, "A secret.", repr=False)


def test_a_flag_parses_with_its_help_choices_and_aliases():
    parser = HfArgumentParser(_Flags)
    (args,) = parser.parse_args_into_dataclasses(args=["--name", "a", "-k", "3", "--key", "hunter2"])
    assert (args.name, args.k, args.mode, args.key) == ("a", 3, "quick", "hunter2")
    assert "hunter2" not in repr(args)
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(args=["--name", "a", "--mode", "slow"])  # not among the choices
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(args=[])  # --name is required
    assert "How to check." in parser.format_help()


def test_a_flag_without_help_is_refused():
    with pytest.raises(ValueError, match="help"):
        flag(1)
