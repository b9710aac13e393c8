"""The one way a vlfit command parses its flags: ``HfArgumentParser`` over its dataclasses, made strict.

- No abbreviations: ``--learning_rat`` is an unknown flag, not ``--learning_rate``.
- A bad flag or value stops in one line, without argparse's usage (which lists every flag: 175 lines for
  ``vlfit train``): the closest known flags (``did you mean --learning_rate?``) and where the flags are listed
  (``see vlfit train --help``), exit 2.
- Values given as a mapping (a flags file, the API's keyword arguments) are converted and checked as the command
  line's are: ``"2"`` for an int flag is 2, ``"ten"`` is refused, ``1e-4`` for a float is 0.0001, a choice must be
  one of its choices; a value of the wrong type (``max_steps=1.5``) is refused naming the flag.
- ``--model`` and ``--model_name_or_path`` name the same field on every command that takes a model.
- A value a dataclass refuses (vlfit's checks, ``TrainingArguments.__post_init__``) is a ``ConfigError``, and so
  is an ``--output_dir`` that names a file (``vlfit.atomic_files.refuse_file_as_folder``), before any work.
- Every field name is registered with ``vlfit.errors``, so messages quote it as a flag on the command line and as a
  keyword argument for Python callers.
- ``hidden_in_help``: flags that still parse but are left out of ``--help`` (``vlfit eval`` lists its own flags, not
  every ``TrainingArguments`` one).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import numbers
import os
import types
import typing
from collections.abc import Collection, Iterable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from transformers import HfArgumentParser

from vlfit.arguments.runtime import INHERITED_FLAGS
from vlfit.atomic_files import refuse_file_as_folder
from vlfit.errors import ConfigError, MissingFileError, UserError, register_option_names
from vlfit.flag_index import unrecognized_message

if TYPE_CHECKING:
    from vlfit.arguments import DataArguments, ModelArguments
    from vlfit.training.arguments import VlfitTrainingArguments

FLAGS_FILE_SUFFIXES = (".json", ".yaml", ".yml")


class ParsedArguments(NamedTuple):
    """The flags of ``vlfit train`` (and of ``vlfit eval``, whose run settings become training arguments).

    Attributes:
        model: Which model, and how to load it.
        data: The data and its input pipeline.
        training: Every ``TrainingArguments`` flag and vlfit's own (``VlfitTrainingArguments``).
        given: Names of the fields the command line or the flags file set, whatever their values (``--no_x`` and
            ``--x False`` set ``x``): what the user asked for, as opposed to defaults.
        auto_workers: ``--dataloader_num_workers auto`` was asked for (then parsed as 0).
        embedding_dim: ``vlfit eval --embedding_dim``: the size evaluation cuts embeddings to (None: the model's).
    """

    model: ModelArguments
    data: DataArguments
    training: VlfitTrainingArguments
    given: frozenset[str]
    auto_workers: bool = False
    embedding_dim: int | None = None


# Fields that name the model under one of two spellings: the command's own and the other one.
MODEL_FLAG_ALIASES = {"model_name_or_path": "--model", "model": "--model_name_or_path"}


def is_flags_file(argv: Sequence[str] | None) -> bool:
    """True when the arguments are one ``.json``/``.yaml``/``.yml`` file holding every flag."""
    return argv is not None and len(argv) == 1 and argv[0].endswith(FLAGS_FILE_SUFFIXES)


def load_flags_file(path: str) -> dict[str, Any]:
    """The flags a ``.json`` or ``.yaml``/``.yml`` file holds, as ``{flag name: value}``."""
    import json

    import yaml

    is_json = path.endswith(".json")
    try:
        with open(os.path.abspath(path), encoding="utf-8") as f:
            values = json.load(f) if is_json else yaml.safe_load(f)
    except FileNotFoundError as err:
        raise MissingFileError(f"{path}: no such flags file") from err
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values, got {type(values).__name__}")
    return values


# Each parser as it printed its help: ``vlfit.flag_index`` writes down its flags, their types and defaults.
HELP_PARSER_RECORD: dict[str, argparse.ArgumentParser] = {}


class CommandParser(HfArgumentParser):
    """``HfArgumentParser`` without abbreviations, with suggestions for unknown flags and ``ConfigError`` values."""

    def __init__(
        self,
        dataclass_types: Any,
        *,
        prog: str,
        description: str | None = None,
        hidden_in_help: Collection[str] = (),
        shown_in_help: Collection[str] | None = None,
        repeatable: Collection[str] = (),
    ) -> None:
        """Args:
        dataclass_types: The dataclasses whose fields are the flags, in the order ``--help`` lists them.
        prog: The command's name (``vlfit eval``).
        description: What ``--help`` says first.
        hidden_in_help: Fields that parse but are not listed by ``--help``.
        shown_in_help: When given, of the fields of the *last* dataclass only these are listed (the rest parse).
        repeatable: List fields whose flag may be given more than once, each time adding to the list
            (``--text a --text b``; argparse would keep only the last).
        """
        types = list(dataclass_types) if isinstance(dataclass_types, Sequence) else [dataclass_types]
        super().__init__(types, prog=prog, description=description, allow_abbrev=False)
        names = {f.name for dtype in types for f in dataclasses.fields(dtype)}
        register_option_names(names)
        hidden = set(hidden_in_help)
        if shown_in_help is not None:
            hidden |= {f.name for f in dataclasses.fields(types[-1])} - set(shown_in_help)
        for action in self._actions:
            if action.dest in MODEL_FLAG_ALIASES and MODEL_FLAG_ALIASES[action.dest] not in self._option_string_actions:
                alias = MODEL_FLAG_ALIASES[action.dest]
                action.option_strings.append(alias)
                self._option_string_actions[alias] = action
            if action.dest in hidden:
                action.help = argparse.SUPPRESS
            if action.dest in repeatable:
                action.__class__ = argparse._ExtendAction  # a list field's nargs="+" action, extending instead
        inherited = {f.name for dtype in types for base in dtype.__mro__[1:] if base.__dict__.get(INHERITED_FLAGS)
                     for f in dataclasses.fields(base)}  # fmt: skip
        for listed in (self._actions, *(group._group_actions for group in self._action_groups)):
            listed.sort(key=lambda action: action.dest in inherited)  # a door's own flags first, then inherited ones
        for group in self._action_groups:  # a group whose every flag is hidden is left out of --help too
            if group._group_actions and all(a.help == argparse.SUPPRESS for a in group._group_actions):
                group.title = None
                group.description = None

    def error(self, message: str) -> NoReturn:
        """Stop as argparse does (exit 2) in one line, pointing at ``--help`` instead of printing the usage."""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def keyword_names(self) -> set[str]:
        """The names a mapping of values may hold: every field, and the model alias the command takes."""
        names = self._field_names()
        return names | {flag.lstrip("-") for field_name, flag in MODEL_FLAG_ALIASES.items() if field_name in names}

    def known_flags(self) -> list[str]:
        """The option strings the parser accepts, in their underscore spelling (HfArgumentParser also takes
        ``--learning-rate`` for ``--learning_rate``: not worth suggesting twice)."""
        return sorted(flag for flag in self._option_string_actions if "-" not in flag.lstrip("-"))

    def refuse_unknown(self, unknown: Iterable[str]) -> None:
        """Stop in one line (exit 2, as argparse), naming each unknown flag and the closest known ones (the line
        ``vlfit.flag_index`` prints before the command is imported)."""
        self.error(unrecognized_message(unknown, self.known_flags()))

    def print_help(self, file: Any = None) -> None:
        """argparse's help; the parser is recorded on the way, for ``vlfit.flag_index`` (its flags and their types)."""
        HELP_PARSER_RECORD[self.prog] = self
        super().print_help(file)

    def typed_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` (field names to values) converted as the command line converts its strings, and checked.

        A string is converted by the flag's own type (``"2"`` -> 2, ``"true"`` -> True), a number of the right
        kind is kept (an int for a float flag becomes a float), a path-like for a string flag becomes its string,
        a single value for a list flag becomes a list of one; choices are checked.

        Raises:
            ConfigError: a value the command line would refuse, or one of another type, naming the flag.
        """
        hints: dict[str, Any] = {}
        defaults: dict[str, Any] = {}
        for dtype in self.dataclass_types:
            type_hints = typing.get_type_hints(dtype)
            for f in dataclasses.fields(dtype):
                hints[f.name] = type_hints.get(f.name, Any)
                defaults[f.name] = f.default
        return {
            name: self._typed(name, value, hints[name], defaults[name]) if name in hints else value
            for name, value in values.items()
        }

    def _typed(self, name: str, value: Any, hint: Any, default: Any) -> Any:
        action = self._option_string_actions.get(f"--{name}")
        kinds = _members(hint)
        if action is None or Any in kinds:
            return value
        if value is None:
            if type(None) in kinds or default is None:
                return None
            raise ConfigError(f"--{name} takes {_described(kinds, action)}, got None")
        listed = next((kind for kind in kinds if typing.get_origin(kind) is list), None)
        if listed is not None and not (isinstance(value, str) and str in kinds):
            items = value if isinstance(value, (list, tuple)) else [value]
            elements = _members(typing.get_args(listed)[0]) if typing.get_args(listed) else [Any]
            return [self._scalar(name, item, elements, action) for item in items]
        return self._scalar(name, value, kinds, action)

    @staticmethod
    def _scalar(name: str, value: Any, kinds: list[Any], action: argparse.Action) -> Any:
        if Any in kinds:
            return value
        if isinstance(value, os.PathLike) and str in kinds:
            value = os.fspath(value)
        if isinstance(value, bool):
            ok = bool in kinds
        elif isinstance(value, numbers.Integral) and (int in kinds or float in kinds):
            value, ok = (int(value) if int in kinds else float(value)), True
        elif isinstance(value, numbers.Real) and float in kinds:
            value, ok = float(value), True
        elif isinstance(value, str) and str in kinds:
            ok = True
        else:
            ok = any(isinstance(kind, type) and isinstance(value, kind) for kind in kinds if kind not in _PLAIN)
            if not ok and isinstance(value, str) and callable(action.type):
                try:
                    value, ok = action.type(value), True
                except (ValueError, TypeError, argparse.ArgumentTypeError):
                    raise ConfigError(f"--{name} takes {_described(kinds, action)}, got {value!r}") from None
        if not ok:
            raise ConfigError(f"--{name} takes {_described(kinds, action)}, got {type(value).__name__} {value!r}")
        if action.choices is not None:
            plain = value.value if isinstance(value, Enum) else value
            if plain not in action.choices:
                raise ConfigError(f"--{name} {plain!r}: choose one of {', '.join(map(str, action.choices))}")
        return value

    @staticmethod
    def _unaliased(values: dict[str, Any], known: Collection[str]) -> dict[str, Any]:
        """``values`` (a flags file, keyword arguments) with a model alias key renamed to the field it names."""
        for field_name, flag in MODEL_FLAG_ALIASES.items():
            alias = flag.lstrip("-")
            if field_name in known and alias not in known and alias in values:
                if field_name in values:
                    raise ConfigError(f"pass --{field_name} or --{alias}, not both")
                values = {**values, field_name: values[alias]}
                del values[alias]
        return values

    def given_fields(self, argv: Sequence[str]) -> frozenset[str]:
        """Names of the fields ``argv`` sets, whatever their values (``--no_x`` and ``--x False`` set ``x``)."""
        defaults = {action: action.default for action in self._actions}
        try:
            for action in self._actions:  # with a SUPPRESS default, argparse leaves a flag not given out
                action.default = argparse.SUPPRESS
            namespace, _ = self.parse_known_args(list(argv))
        finally:
            for action, default in defaults.items():
                action.default = default
        return frozenset(vars(namespace))

    def parse(self, argv: Sequence[str]) -> tuple[tuple[Any, ...], frozenset[str]]:
        """The dataclasses of ``argv`` (flags, or one flags file) and the names of the fields it set."""
        if is_flags_file(argv):
            return self.parse_values(load_flags_file(argv[0]))
        parsed = self.parse_args_into_dataclasses(args=list(argv))
        return parsed, self.given_fields(argv)

    def parse_values(self, values: dict[str, Any]) -> tuple[tuple[Any, ...], frozenset[str]]:
        """The dataclasses of ``{flag: value}`` (a flags file, the API's keyword arguments) and the fields it set."""
        values = self._unaliased(values, self._field_names())
        return self.parse_dict(values), frozenset(values)

    def _field_names(self) -> set[str]:
        return {f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype)}

    def parse_args_into_dataclasses(  # type: ignore[override]
        self, args: Sequence[str] | None = None, return_remaining_strings: bool = False, **kwargs: Any
    ) -> tuple[Any, ...]:
        try:
            *parsed, remaining = super().parse_args_into_dataclasses(args=args, return_remaining_strings=True, **kwargs)
        except UserError:
            raise
        except ValueError as error:  # a dataclass's __post_init__ refused a value (TrainingArguments' own checks)
            raise ConfigError(str(error)) from error
        if return_remaining_strings:
            return (*parsed, remaining)
        if remaining:
            self.refuse_unknown(remaining)
        return _checked_output_dir(tuple(parsed))

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple[Any, ...]:  # type: ignore[override]
        known = self._field_names()
        args = self._unaliased(args, known)
        unknown = sorted(set(args) - known)
        if unknown and not allow_extra_keys:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=2, cutoff=0.6)
                hints.append(f"{key} (did you mean {' or '.join(close)}?)" if close else key)
            raise ConfigError(f"unknown option{'s' if len(hints) > 1 else ''} {', '.join(hints)}")
        args = self.typed_values(args)
        try:
            parsed = super().parse_dict(args, allow_extra_keys=allow_extra_keys)
        except UserError:
            raise
        except (ValueError, TypeError) as error:
            raise ConfigError(str(error)) from error
        return _checked_output_dir(parsed)


def _checked_output_dir(parsed: tuple[Any, ...]) -> tuple[Any, ...]:
    """``parsed``, once an ``output_dir`` in it that names a file is refused (every command writes a folder there)."""
    for args in parsed:
        if isinstance(getattr(args, "output_dir", None), str) and args.output_dir:
            refuse_file_as_folder(args.output_dir)
    return parsed


_PLAIN = (bool, int, float, str)
_KIND_WORDS = {bool: "true or false", int: "an int", float: "a number", str: "a string", dict: "a dict"}


def _members(hint: Any) -> list[Any]:
    """The types a field's hint allows: a union's members (``int | None``), a ``Literal``'s values' types."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return [member for arg in typing.get_args(hint) for member in _members(arg)]
    if origin is typing.Literal:
        return list(dict.fromkeys(type(arg) for arg in typing.get_args(hint)))
    return [hint]


def _described(kinds: list[Any], action: argparse.Action) -> str:
    if action.choices is not None:
        return f"one of {', '.join(map(str, action.choices))}"
    words = [_KIND_WORDS.get(kind) or getattr(kind, "__name__", str(kind)) for kind in kinds if kind is not type(None)]
    return " or ".join(dict.fromkeys(words))
