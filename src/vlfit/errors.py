"""vlfit's exceptions: every mistake of the caller (a flag, a file, the data, a model folder) is a ``UserError``.

The CLI (``vlfit.cli.main``) prints a ``UserError`` as one line and exits with 2; anything else is a bug and keeps
its traceback. Python callers catch ``vlfit.UserError`` (or one of its kinds) the same way.

Messages are written with the CLI's flag names (``--freeze``). A message names an option as ``--name`` only where
the CLI produced it: for a Python caller, who passed ``freeze=...``, ``str(err)`` shows the option as ```freeze```.
Only names of vlfit's options are rewritten (``register_option_names``), so a command line quoted in a message
(``torchrun --nproc_per_node 2``) stays as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_OPTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)")
_option_names: set[str] = set()
_cli_wording = False


def register_option_names(names: Iterable[str]) -> None:
    """Record option names (dataclass fields of a command's arguments) that messages may quote as ``--name``."""
    _option_names.update(names)


def set_cli_wording(on: bool) -> bool:
    """Word messages for a command line (``--name``) or for Python callers; returns the previous setting.

    ``vlfit.cli.main`` turns it on while a command runs, and back to what it was when it returns.
    """
    global _cli_wording
    previous, _cli_wording = _cli_wording, on
    return previous


def python_wording(message: str) -> str:
    """``message`` with each ``--option`` of vlfit's written as the keyword argument a Python caller passed."""
    return _OPTION.sub(lambda m: f"`{m.group(1)}`" if m.group(1) in _option_names else m.group(0), message)


class UserError(Exception):
    """Something the caller gave is wrong: the message names it and says what to do."""

    def __str__(self) -> str:
        message = super().__str__()
        return message if _cli_wording else python_wording(message)


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
        detail = f" ({module} is not installed)" if module else ""
        super().__init__(f"{what} needs the {extra} extra{detail}: pip install 'vlfit[{extra}]'")
        self.extra = extra


def require_extra(module: str, extra: str, what: str) -> None:
    """Import ``module`` or raise ``MissingExtraError`` naming ``extra`` and ``what`` needs it.

    Args:
        module: The module the extra provides (``"onnxruntime"``).
        extra: The extra's name in ``pyproject.toml`` (``"export"``).
        what: Who needs it, as the message's subject (``"vlfit export"``).
    """
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(what, extra, module) from err
