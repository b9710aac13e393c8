"""The runtime flags every model door shares: declared once, inherited, handed on as one ``RuntimeSettings``."""

from __future__ import annotations

import dataclasses

import pytest

from vlfit.arguments.runtime import RUNTIME_FLAGS, RuntimeFlags, runtime_arguments
from vlfit.commands.classify import ClassifyArguments
from vlfit.commands.export import ExportArguments
from vlfit.commands.parsing import CommandParser
from vlfit.commands.retrieve import IndexArguments, QueryArguments
from vlfit.commands.serve import ServeArguments
from vlfit.commands.vqa import VqaArguments
from vlfit.errors import ConfigError
from vlfit.inference.runtime_settings import RuntimeSettings

DOORS = (IndexArguments, QueryArguments, ServeArguments, ExportArguments, VqaArguments, ClassifyArguments)


@pytest.mark.parametrize("door", DOORS, ids=lambda door: door.__name__)
def test_every_door_inherits_its_runtime_flags_and_declares_none(door):
    own = set(door.__dict__.get("__annotations__", {}))
    assert issubclass(door, RuntimeFlags)
    assert not own & set(RUNTIME_FLAGS), f"{door.__name__} re-declares {sorted(own & set(RUNTIME_FLAGS))}"
    assert {f.name for f in dataclasses.fields(door)} & set(RUNTIME_FLAGS)


def test_flags_parse_into_one_settings_value():
    parser = CommandParser(QueryArguments, prog="vlfit retrieve query")
    (args,) = parser.parse_args_into_dataclasses(
        args=["--index", "x", "--precision", "fp32", "--num_threads", "2", "--max_seq_length", "9"]
    )
    assert args.settings() == RuntimeSettings(precision="fp32", num_threads=2, max_seq_length=9)
    assert args.settings(allow_spinning=False).allow_spinning is False  # what the door decides itself


def test_a_door_takes_only_the_flags_it_names_with_its_own_defaults():
    assert {f.name for f in dataclasses.fields(ExportArguments)} & set(RUNTIME_FLAGS) == {
        "max_seq_length",
        "max_num_patches",
    }
    assert ServeArguments(index="x").settings().num_threads == 1  # the server's default: batching is its concurrency
    assert QueryArguments(index="x").settings().num_threads is None
    with pytest.raises(SystemExit):  # argparse refuses a flag the door does not take
        CommandParser(ExportArguments, prog="vlfit export").parse_args_into_dataclasses(
            args=["--model_name_or_path", "m", "--output_dir", "o", "--backend", "openvino"]
        )
    with pytest.raises(KeyError):
        runtime_arguments("beam_width")


def test_a_bad_value_is_refused_naming_its_flag():
    with pytest.raises(ConfigError, match="--num_threads must be at least 1"):
        QueryArguments(index="x", num_threads=0).settings()


def test_help_lists_a_doors_own_flags_before_the_runtime_flags():
    text = CommandParser(IndexArguments, prog="vlfit retrieve index").format_help()
    assert text.index("--output_dir") < text.index("--backend") < text.index("--max_num_patches")


def test_unset_settings_are_taken_from_how_the_index_was_built():
    built = {"backend": "onnxruntime", "precision": "int8", "max_seq_length": 12, "max_num_patches": 64}
    assert RuntimeSettings().as_built(built) == RuntimeSettings("onnxruntime", "int8", None, 12, None, True, 64)
    asked = RuntimeSettings(backend="torch", precision="fp32", max_seq_length=7, max_num_patches=32)
    assert asked.as_built(built) == asked  # what the caller asked for stays


def test_the_servers_limits_are_declared_once_and_inherited_as_flags():
    from vlfit.serve.limits import ServerLimits

    limits = {f.name for f in dataclasses.fields(ServerLimits)}
    assert not limits & set(ServeArguments.__dict__.get("__annotations__", {}))  # none re-declared by the door
    assert limits <= {f.name for f in dataclasses.fields(ServeArguments)}
    parser = CommandParser(ServeArguments, prog="vlfit serve")
    (args,) = parser.parse_args_into_dataclasses(args=["--index", "x", "--max_concurrency", "7"])
    assert args.limits() == ServerLimits(max_concurrency=7)
    assert all(f.metadata.get("help") for f in dataclasses.fields(ServerLimits))  # each field's help is its flag's
