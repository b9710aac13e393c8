"""``flag``: how every command-line flag of vlfit is declared, a dataclass field that ``HfArgumentParser`` reads.

A flag is a field of an arguments dataclass whose metadata holds its help (and its choices or aliases, where it has
them), as transformers' own ``TrainingArguments`` declare theirs::

    port: int = flag(8000, "TCP port (0: any free one, printed at start).")
    index: str = flag(help="The index folder (vlfit retrieve index's output).")  # required: no default
    verify: str = flag("quick", "How the index is checked ...", choices=("quick", "full"))

It sits on the ground floor so that every layer that declares flags (the commands, the arguments, the server's
limits, the search's study, the compatibility flags) can use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


def flag(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: Iterable[Any] | None = None,
    aliases: list[str] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    repr: bool = True,
) -> Any:
    """A flag: a ``dataclasses.field`` with its ``--help`` text, choices and aliases in the metadata, the keys
    ``HfArgumentParser`` passes to ``argparse``.

    Args:
        default: The value when the flag is not given; leave it out for a required flag (or give ``default_factory``).
        help: What ``--help`` says of the flag.
        choices: The values the flag takes (argparse refuses others).
        aliases: Other option strings of the flag (``["-k"]``).
        default_factory: Makes the default (a list, say) when the flag is not given.
        repr: False for a secret, left out of the dataclass's repr (an API key).

    Raises:
        ValueError: for a flag without help (a programming error: ``--help`` would say nothing of it).
    """
    if not help:
        raise ValueError("a flag needs its help: what --help says of it")
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if aliases is not None:
        metadata["aliases"] = aliases
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr, metadata=metadata)
