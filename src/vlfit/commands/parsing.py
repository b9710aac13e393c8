"""The one way a vlfit command parses its flags: ``HfArgumentParser`` over its dataclasses, made strict.

- No abbreviations: ``--learning_rat`` is an unknown flag, not ``--learning_rate``.
- An unknown flag stops with argparse's usage line and the closest known flags (``did you mean --learning_rate?``).
- ``--model`` and ``--model_name_or_path`` name the same field on every command that takes a model.
- A value a dataclass refuses (vlfit's checks, ``TrainingArguments.__post_init__``) is a ``ConfigError``.
- Every field name is registered with ``vlfit.errors``, so messages quote it as a flag on the command line and as a
  keyword argument for Python callers.
- ``hidden_in_help``: flags that still parse but are left out of ``--help`` (``vlfit eval`` lists its own flags, not
  every ``TrainingArguments`` one).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from transformers import HfArgumentParser

from vlfit.errors import ConfigError, UserError, register_option_names

# Fields that name the model under one of two spellings: the command's own and the other one.
MODEL_FLAG_ALIASES = {"model_name_or_path": "--model", "model": "--model_name_or_path"}


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
    ) -> None:
        """Args:
        dataclass_types: The dataclasses whose fields are the flags, in the order ``--help`` lists them.
        prog: The command's name (``vlfit eval``).
        description: What ``--help`` says first.
        hidden_in_help: Fields that parse but are not listed by ``--help``.
        shown_in_help: When given, of the fields of the *last* dataclass only these are listed (the rest parse).
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
        for group in self._action_groups:  # a group whose every flag is hidden is left out of --help too
            if group._group_actions and all(a.help == argparse.SUPPRESS for a in group._group_actions):
                group.title = None
                group.description = None

    def known_flags(self) -> list[str]:
        """The option strings the parser accepts, in their underscore spelling (HfArgumentParser also takes
        ``--learning-rate`` for ``--learning_rate``: not worth suggesting twice)."""
        return sorted(flag for flag in self._option_string_actions if "-" not in flag.lstrip("-"))

    def refuse_unknown(self, unknown: Iterable[str]) -> None:
        """Stop as argparse does (usage, exit 2), naming each unknown flag and the closest known ones."""
        flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
        others = [arg for arg in unknown if not arg.startswith("-")]
        parts = []
        for flag in flags:
            close = difflib.get_close_matches(flag, self.known_flags(), n=2, cutoff=0.75)
            parts.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
        if others and not flags:
            parts.append(" ".join(others))
        self.error(f"unrecognized arguments: {', '.join(parts)}")

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
        return tuple(parsed)

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple[Any, ...]:  # type: ignore[override]
        known = {f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype)}
        unknown = sorted(set(args) - known)
        if unknown and not allow_extra_keys:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=2, cutoff=0.6)
                hints.append(f"{key} (did you mean {' or '.join(close)}?)" if close else key)
            raise ConfigError(f"unknown option{'s' if len(hints) > 1 else ''} {', '.join(hints)}")
        try:
            return super().parse_dict(args, allow_extra_keys=allow_extra_keys)
        except UserError:
            raise
        except (ValueError, TypeError) as error:
            raise ConfigError(str(error)) from error
