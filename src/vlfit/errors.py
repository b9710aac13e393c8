"""vlfit's exceptions: every mistake of the caller (a flag, a file, the data, a model folder) is a ``UserError``.

The CLI (``vlfit.cli.main``) prints a ``UserError`` as one line and exits with 2; anything else is a bug and keeps
its traceback. Python callers catch ``vlfit.UserError`` (or one of its kinds) the same way.

Messages are written with the CLI's flag names (``--freeze``). Where a Python caller passed the option as a
keyword argument (``vlfit.train(freeze=...)``), the API rewords the message as it leaves (``python_api``): the
option is then quoted as the keyword, ```freeze=```, with its value when the message gives one
(``--images /x: no such folder`` becomes ```images=/x`: no such folder``). Only the keywords of the function
called are rewritten (for ``vlfit.train``, every registered option name: ``register_option_names``), and never
inside a quoted command line (``vlfit export --model_name_or_path x``, ``torchrun --nproc_per_node 2``).

``python_api`` also checks a call before the function runs: an unknown keyword gets the closest ones (``did you
mean `precision=`?``), a value of the wrong type is refused, both as an ``ArgumentError``.
"""

from __future__ import annotations

import difflib
import errno
import functools
import inspect
import numbers
import os
import re
import reprlib
import shutil
import threading
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# ``--name``, with the value that follows it when it looks like one: quoted, a number, or a path.
_OPTION = re.compile(
    r"(?<![\w-])--([a-z][a-z0-9_]*)(?: ('[^']*'|\"[^\"]*\"|-?\d[\w.+-]*|[^\s;,()'\"]*/[^\s;,()'\"]*))?"
)
_COMMAND_LINE = re.compile(r"\b(?:vlfit [a-z]|torchrun\b|accelerate launch\b|python -m\b)")
_option_names: set[str] = set()


def register_option_names(names: Iterable[str]) -> None:
    """Record option names (dataclass fields of a command's arguments) that messages may quote as ``--name``."""
    _option_names.update(names)


def python_wording(message: str, keywords: Mapping[str, str] | None = None) -> str:
    """``message`` with each ``--option`` of vlfit's written as the keyword argument a Python caller passed.

    Args:
        message: A message in the CLI's words.
        keywords: ``{option: keyword}`` of the function called (default: every registered option, as itself).
    """

    def keyword(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        clause = re.split(r"[;()]", message[: match.start()])[-1]
        target = keywords.get(name) if keywords is not None else (name if name in _option_names else None)
        if target is None or _COMMAND_LINE.search(clause):  # not a keyword, or inside a quoted command line
            return match.group(0)
        if value is None:
            return f"`{target}=`"
        trailing = len(value) - len(value.rstrip(":."))
        value, rest = value[: len(value) - trailing], value[len(value) - trailing :]
        return f"`{target}={value}`{rest}"

    return _OPTION.sub(keyword, message)


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


class WriteFailedError(UserError, OSError):
    """A write that failed without saying why (torch's zip writer loses the errno): names the folder, its free space
    and what to do."""


class DiskFullError(WriteFailedError):
    """A write that ran out of disk space (or quota): names the folder, its free space and what to do."""


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What torch's zip writer (torch.save) raises when a write fails: the errno is lost, so a full disk reads as the
# stream's "unexpected pos N vs M" (the C++ stream's "basic_ios::clear: iostream error" as its context, or alone
# when the file is small enough to fail only as it is flushed).
TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "file write failed", "basic_ios::clear")
# Free space under which a write that failed without a cause is taken for a full disk, when it needed less than this.
LOW_SPACE_BYTES = 16_000_000
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how a Rust library (safetensors) words an OSError's errno
_ENFORCE = re.compile(r"^\[enforce fail at [^\]]*\]\s*\.?\s*")  # the C++ source line torch's message starts with


def format_bytes(size: float) -> str:
    """``size`` in the unit a disk-space message gives it: MB from one megabyte up (free space, checkpoints, graphs),
    kB or bytes below (an index shard of a small model)."""
    if size >= 1e6:
        return f"{size / 1e6:,.0f} MB"
    return f"{size / 1e3:,.0f} kB" if size >= 1e3 else f"{size:.0f} bytes"


def disk_full_error(
    error: OSError,
    folder: str,
    *,
    needed: int | None = None,
    note: str = "",
    remedy: str = "free space there or write elsewhere (--output_dir)",
) -> DiskFullError:
    """``error`` (a write that found no space) as one line: the folder, its free space and, when known, about
    how much the write needed; ``note`` adds what the caller knows (what is kept: the last complete checkpoint, the
    shards an index lists), ``remedy`` what to do."""
    try:
        where = folder if os.path.isdir(folder) else os.path.dirname(folder) or "."
        free = f"{format_bytes(shutil.disk_usage(where).free)} free"
    except OSError:
        free = "free space unknown"
    need = f", about {format_bytes(needed)} needed" if needed else ""
    written = f" writing {error.filename}" if error.filename else ""
    extra = f"; {note}" if note else ""
    return DiskFullError(f"no space left on the device of {folder}{written} ({free}{need}){extra}: {remedy}")


def error_chain(error: BaseException, *, follow_suppressed: bool = True) -> Iterator[BaseException]:
    """``error``, then what it was raised from or during (``__cause__``, else ``__context__``), to the first.

    Args:
        error: Where the chain starts.
        follow_suppressed: Also follow a ``__context__`` that ``raise ... from None`` hid (a write failure
            re-raised as another error is still one); ``False`` stops there.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        hidden = current.__suppress_context__ and not follow_suppressed
        current = current.__cause__ or (None if hidden else current.__context__)


def _free_bytes(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder if os.path.isdir(folder) else os.path.dirname(folder) or ".").free
    except OSError:
        return None


def failed_write_error(
    error: BaseException,
    folder: str,
    *,
    needed: int | None = None,
    note: str = "",
    remedy: str = "free space there or write elsewhere (--output_dir)",
) -> WriteFailedError | None:
    """``error`` as one line when it is a write into ``folder`` that failed for want of space; None for any other.

    Recognised: an ``OSError`` with ENOSPC or EDQUOT anywhere in its ``__cause__``/``__context__`` chain (worded by
    ``disk_full_error``), or an error that quotes one as a Rust library does (safetensors' ``SafetensorError``:
    "... (os error 28)"), and torch's zip-writer failures (``TORCH_WRITE_FAILURES``), which lose the errno: these
    say "no space left" only when the folder's free space is low (under ``needed``, or ``LOW_SPACE_BYTES`` when the
    write needed less or its size is unknown), and otherwise that the write failed, in torch's words, with the free
    space. A ``UserError`` is never one (it already says what happened).

    Args:
        error: What the write raised.
        folder: The folder written into (free space is measured there).
        needed: About how many bytes the write needed, when known.
        note: What the caller knows (what was kept: the last complete checkpoint, the shards a manifest lists).
        remedy: What to do.
    """
    if isinstance(error, UserError):
        return None
    chain = list(error_chain(error))
    for link in chain:
        if isinstance(link, OSError) and link.errno in NO_SPACE_ERRNOS:
            return disk_full_error(link, folder, needed=needed, note=note, remedy=remedy)
        rust = _RUST_OS_ERROR.search(str(link))  # safetensors' writer: "No space left on device (os error 28)"
        if rust and int(rust.group(1)) in NO_SPACE_ERRNOS:
            full = OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
            return disk_full_error(full, folder, needed=needed, note=note, remedy=remedy)
    words = next(
        (
            _ENFORCE.sub("", first_line(link, 200))
            for link in chain
            if isinstance(link, RuntimeError) and any(phrase in str(link) for phrase in TORCH_WRITE_FAILURES)
        ),
        None,
    )
    if words is None:
        return None
    free = _free_bytes(folder)
    if free is not None and free < max(needed or 0, LOW_SPACE_BYTES):
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return disk_full_error(full, folder, needed=needed, note=note, remedy=remedy)
    shown = f"{format_bytes(free)} free" if free is not None else "free space unknown"
    need = f", about {format_bytes(needed)} needed" if needed else ""
    extra = f"; {note}" if note else ""
    return WriteFailedError(f"the write to {folder} failed (torch: {words}; {shown}{need}){extra}: {remedy}")


@contextmanager
def full_disk_in_one_line(
    folder: str,
    *,
    needed: int | None = None,
    note: str = "",
    remedy: str = "free space there or write elsewhere (--output_dir)",
) -> Iterator[None]:
    """Writes inside the block that run out of disk space (or quota) raise ``failed_write_error``'s one line with
    these words; any other error passes as it is."""
    try:
        yield
    except Exception as error:
        failure = failed_write_error(error, folder, needed=needed, note=note, remedy=remedy)
        if failure is None:
            raise
        raise failure from error


class OutOfMemoryError(UserError, MemoryError):
    """A training or evaluation step that ran out of device or host memory: names the flags that set its size."""


# How torch words a failed allocation beside its OutOfMemoryError (CUDA, MPS): the CPU allocator's RuntimeError
# ("DefaultCPUAllocator: can't allocate memory", "not enough memory" on other systems).
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or what it was raised from or during, is a failed allocation: a ``MemoryError``, torch's
    ``OutOfMemoryError`` or an allocator's ``RuntimeError`` (``OUT_OF_MEMORY_WORDS``)."""
    return any(
        isinstance(link, MemoryError)
        or type(link).__name__ == "OutOfMemoryError"
        or (isinstance(link, RuntimeError) and any(words in str(link) for words in OUT_OF_MEMORY_WORDS))
        for link in error_chain(error)
    )


def _allocation_words(error: BaseException) -> str:
    """Torch's own words for a failed allocation, its first two sentences: ``CUDA out of memory. Tried to allocate
    80.00 GiB.``, ``DefaultCPUAllocator: can't allocate memory: you tried to allocate 85899345920 bytes. ...``."""
    words = _ENFORCE.sub("", first_line(error))
    allocator = words.find("DefaultCPUAllocator")  # after the C++ check that failed ("err == 0.")
    sentences = re.split(r"(?<=\.)\s+", words[max(allocator, 0) :])
    return " ".join(sentences[:2])[:200]


@contextmanager
def out_of_memory_in_one_line(step: str, sizes: Mapping[str, Any], note: str = "") -> Iterator[None]:
    """A step inside the block that runs out of memory raises one line naming the flags that set its size (with
    their values) instead of torch's traceback; any other error passes as it is.

    Args:
        step: What ran out (``a training step``).
        sizes: The flags that set a step's size, by name, with their values (``None``: not this run's, left out).
        note: What else the reader should know (a square image's size is the model's, not a flag).
    """
    try:
        yield
    except Exception as error:
        if isinstance(error, UserError) or not is_out_of_memory(error):
            raise
        flags = [f"--{name} ({value})" for name, value in sizes.items() if value is not None]
        lower = ", ".join(flags[:-1]) + f" or {flags[-1]}" if len(flags) > 1 else "".join(flags)
        extra = f"; {note}" if note else ""
        words = _allocation_words(error)
        raise OutOfMemoryError(f"out of memory in {step} (torch: {words}): lower {lower}{extra}") from error


class ArgumentError(ConfigError, TypeError):
    """A call of the Python API with an unknown keyword, a missing or extra argument, or a value of the wrong type
    (a ``TypeError`` too, as Python's own for a bad call)."""


def unknown_keywords(function: str, unknown: Iterable[str], known: Iterable[str]) -> ArgumentError:
    """The error for keywords ``function`` does not take, each with the closest it does (``did you mean``)."""
    known = sorted(known)
    parts = []
    for name in sorted(unknown):
        small = len(known) <= 30  # a signature, not a command's hundreds of flags
        close = difflib.get_close_matches(name, known, n=3 if small else 2, cutoff=0.5 if small else 0.6)
        quoted = [f"`{c}=`" for c in close]
        choices = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else "".join(quoted)
        hint = f" (did you mean {choices}?)" if close else ""
        parts.append(f"`{name}=`{hint}")
    plural = "s" if len(parts) > 1 else ""
    return ArgumentError(f"{function}() got an unknown keyword argument{plural} {', '.join(parts)}")


def _members(hint: Any) -> list[Any]:
    """The types a hint allows: the members of a union (``X | None``), or the hint itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [member for arg in typing.get_args(hint) for member in _members(arg)]
    return [hint]


def _accepts(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type, looking one level deep (``Sequence[str]``: a sequence)."""
    for member in _members(hint):
        if member is Any or member is None or member is type(None):
            if member is Any or value is None:
                return True
            continue
        if member is bool:
            ok = isinstance(value, bool)
        elif member is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        elif member is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        else:
            origin = typing.get_origin(member) or member
            ok = not isinstance(origin, type) or isinstance(value, origin)
        if ok:
            return True
    return False


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


class _Calls(threading.local):
    depth = 0  # python_api functions running in this thread (the outermost one rewords)


_calls = _Calls()
_command_line = [0]  # > 0: a CLI command is running; its messages keep the flags' names


@contextmanager
def cli_wording() -> Iterator[None]:
    """While a CLI command runs, messages of the API functions it calls keep the CLI's flag names."""
    _command_line[0] += 1
    try:
        yield
    finally:
        _command_line[0] -= 1


def python_api(function: F | None = None, *, renames: Mapping[str, str] | None = None, flags: bool = False) -> Any:
    """Decorate a public function of the Python API.

    Before it runs, the call is checked against its signature: an unknown keyword (with the closest ones), a
    missing or extra argument, or a value that is not of the annotated type raises an ``ArgumentError``. A
    ``UserError`` it raises leaves worded for Python callers (``python_wording``) with the keywords of the outermost
    API function called: its parameters, ``renames`` (``{"index": "path"}``: the flag ``--index`` is the keyword
    ``path=``), and, with ``flags`` (a function taking a command's flags as ``**flags``), every registered option.
    Called while a CLI command runs (``cli_wording``), messages keep the flags' names.
    """
    if function is None:
        return functools.partial(python_api, renames=renames, flags=flags)
    signature = inspect.signature(function)
    parameters = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    own = {p.name: p.name for p in parameters if p.name not in ("self", "cls")} | dict(renames or {})
    name = function.__qualname__
    hints: list[dict[str, Any]] = []  # the resolved annotations, on the first call (the module is loaded by then)

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            known = [p.name for p in parameters]
            unknown = [key for key in kwargs if key not in known]
            if unknown and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
                raise unknown_keywords(name, unknown, (k for k in known if k not in ("self", "cls"))) from None
            raise ArgumentError(f"{name}(): {error}") from None
        if not hints:
            hints.append(typing.get_type_hints(function))
        for key, value in bound.arguments.items():
            hint = hints[0].get(key)
            if hint is not None and key in own and not _accepts(value, hint):
                annotation = function.__annotations__.get(key)
                shown = annotation if isinstance(annotation, str) else getattr(hint, "__name__", str(hint))
                raise ArgumentError(f"`{key}=` must be {shown}, got {_shown(value)}")

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = _calls.depth == 0
        _calls.depth += 1
        try:
            check(args, kwargs)
            return function(*args, **kwargs)
        except UserError as error:
            keywords = dict(own)
            if flags:
                keywords |= {option: option for option in _option_names if option not in keywords}
            scopes = error.__dict__.setdefault("_python_keywords", [])
            scopes.append(keywords)  # innermost first: an outer function's keyword wins
            if outer and not _command_line[0] and error.args and isinstance(error.args[0], str):
                merged = {key: value for scope in scopes for key, value in scope.items()}
                error.args = (python_wording(error.args[0], merged), *error.args[1:])
            raise
        finally:
            _calls.depth -= 1

    return wrapper
