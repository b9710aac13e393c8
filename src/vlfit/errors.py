"""vlfit's exceptions: every mistake of the caller (a flag, a file, the data, a model folder) is a ``UserError``.

The CLI (``vlfit.cli.main``) prints a ``UserError`` as one line and exits with 2; anything else is a bug and keeps
its traceback. Python callers catch ``vlfit.UserError`` (or one of its kinds) the same way.

Messages are written with the CLI's flag names (``--freeze``). Where a Python caller passed the option as a
keyword argument (``vlfit.train(freeze=...)``), the API rewords the message as it leaves (``python_api``): the
option is then quoted as ```freeze```. Only names of vlfit's options are rewritten (``register_option_names``), so
a command line quoted in a message (``torchrun --nproc_per_node 2``) stays as it is.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_OPTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)")
_option_names: set[str] = set()


def register_option_names(names: Iterable[str]) -> None:
    """Record option names (dataclass fields of a command's arguments) that messages may quote as ``--name``."""
    _option_names.update(names)


def python_wording(message: str) -> str:
    """``message`` with each ``--option`` of vlfit's written as the keyword argument a Python caller passed."""
    return _OPTION.sub(lambda m: f"`{m.group(1)}`" if m.group(1) in _option_names else m.group(0), message)


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of ``error``'s message (at most ``limit`` characters), or its type's name: how a
    ``UserError`` quotes the library error it replaces."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(error).__name__


class UserError(Exception):
    """Something the caller gave is wrong: the message names it and says what to do."""


class ConfigError(UserError, ValueError):
    """An option's value, or a combination of options, that vlfit refuses."""


class DataError(UserError, ValueError):
    """The data: a split, column, file or sample that is missing or cannot be read."""


class MissingFileError(DataError, FileNotFoundError):
    """A file or folder the caller named does not exist."""


class ModelLoadError(UserError, OSError):
    """A model, tokenizer or image processor that cannot be loaded from the folder or hub id given."""


class MissingExtraError(UserError, ImportError):
    """A command or function needs an optional dependency group (an extra) that is not installed."""

    def __init__(self, what: str, extra: str, module: str | None = None) -> None:
        detail = f" ({module} not installed)" if module else ""
        super().__init__(f"{what} needs the {extra} extra{detail}: pip install 'vlfit[{extra}]'")
        self.extra = extra


def python_api(function: F) -> F:
    """Decorate a public function: a ``UserError`` it raises leaves worded for Python callers (``python_wording``)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except UserError as error:
            if error.args and isinstance(error.args[0], str):
                error.args = (python_wording(error.args[0]), *error.args[1:])
            raise

    return wrapper  # type: ignore[return-value]
