"""The flags every model door shares, declared once: ``RuntimeArguments`` and ``runtime_arguments``.

A door (``vlfit retrieve index`` and ``query``, ``vlfit serve``, ``vlfit export``, ``vlfit vqa``, ``vlfit classify``
...) inherits the runtime flags it takes from ``runtime_arguments(NAMES...)`` and hands its model one value,
``settings()`` (a ``vlfit.inference.runtime_settings.RuntimeSettings``), which travels whole to ``ModelRuntime``.
A door never re-declares a runtime flag: a new setting is a field here and in ``RuntimeSettings``, and every door that
lists its name gets it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from vlfit.flags import flag
from vlfit.inference.runtime_settings import RuntimeSettings


@dataclass(frozen=True)
class _RuntimeFlagDeclarations:
    """Each runtime flag's type, default and help: the one declaration (``runtime_arguments`` hands a door the ones
    it takes)."""

    backend: Literal["auto", "torch", "onnxruntime", "openvino"] = flag(
        "auto",
        "Which runtime embeds: auto (the model folder's own: PyTorch for a checkpoint, the exported "
        "format's runtime for an export; for an index's model, the runtime it was built with), torch, "
        "onnxruntime or openvino.",
    )
    precision: Literal["auto", "fp32", "int8", "bf16"] = flag(
        "auto",
        "Exported graphs: auto (INT8 when exported; for an index's model, the precision it was "
        "built with), fp32, int8, or bf16 (an OpenVINO export on a CPU with AMX or AVX-512 bf16).",
    )
    num_threads: int | None = flag(
        None,
        "Intra-op threads of the runtime (torch, ONNX Runtime, OpenVINO), for this model's calls "
        "only; unset: the runtime's own.",
    )
    max_seq_length: int | None = flag(
        None,
        "Cut captions at this many tokens (default: the length the model was trained with, from "
        "its input_spec.json or export manifest; for an index's model, the length it was indexed with).",
    )
    max_num_patches: int | None = flag(
        None,
        "A NaFlex model's (SigLIP 2) most patches per image (default: the budget the model was "
        "trained with; for an index's model, the budget it was built with).",
    )
    embedding_dim: int | None = flag(
        None,
        "Keep the first this many dimensions of every embedding, L2-normalized again (a Matryoshka "
        "run's --matryoshka_dims; another size is allowed, with a note). Default: the model's full size; "
        "for an index's model, the size it was built with (a query asking another is refused).",
    )


RUNTIME_FLAGS = tuple(f.name for f in dataclasses.fields(_RuntimeFlagDeclarations))
INHERITED_FLAGS = "__inherited_flags__"  # marks a dataclass of flags declared elsewhere (``flags_of``)


@dataclass(kw_only=True)
class RuntimeFlags:
    """What every door's runtime flags share: ``settings()``, the one value its model runs with."""

    def settings(self, **fixed: Any) -> RuntimeSettings:
        """These flags as a ``RuntimeSettings``; ``fixed`` are settings the door decides itself (``backend="torch"``
        for a door that reads checkpoints, ``allow_spinning=False`` for a server).

        Raises:
            ConfigError: for a value out of range, naming its flag.
        """
        given = {name: getattr(self, name) for name in RUNTIME_FLAGS if hasattr(self, name)}
        return RuntimeSettings(**{**given, **fixed})


def flags_of(settings: type, names: tuple[str, ...] | None = None, base: type = object, **defaults: Any) -> type:
    """The fields of a settings dataclass (``vlfit.serve.limits.ServerLimits`` ...: its help in each field's
    metadata), or the ``names`` of them, as a keyword-only dataclass of flags a door's arguments inherit, with the
    door's own ``defaults``: the door's required fields may follow them, it never re-declares one, and it builds the
    settings from them. ``--help`` lists them after the door's own flags (``INHERITED_FLAGS``)."""
    declared = [(f.name, f.type, field(default=defaults.get(f.name, f.default), metadata=f.metadata))
                for f in dataclasses.fields(settings) if names is None or f.name in names]  # fmt: skip
    label = "".join(part.title() for name, _, _ in declared for part in name.split("_")) if names else "Flags"
    cls = dataclasses.make_dataclass(f"{settings.__name__.strip('_')}{label}", declared, bases=(base,), kw_only=True)
    cls.__module__ = settings.__module__
    setattr(cls, INHERITED_FLAGS, True)
    return cls


def runtime_arguments(*names: str, **defaults: Any) -> type[RuntimeFlags]:
    """The runtime flags a door takes, for its arguments dataclass to inherit: ``names`` of ``RUNTIME_FLAGS`` (all
    of them when none are named), with the door's own ``defaults`` where they differ (``vlfit serve``:
    ``num_threads=1``). The flags are keyword-only, so the door's required fields may follow.

    Raises:
        KeyError: for a name that is not a runtime flag (a programming error).
    """
    chosen = names or RUNTIME_FLAGS
    unknown = (set(chosen) | set(defaults)) - set(RUNTIME_FLAGS)
    if unknown or not set(defaults) <= set(chosen):
        raise KeyError(f"not runtime flags of this door: {sorted(unknown or set(defaults) - set(chosen))}")
    return _runtime_arguments(tuple(chosen), tuple(sorted(defaults.items())))


@functools.cache
def _runtime_arguments(names: tuple[str, ...], defaults: tuple[tuple[str, Any], ...]) -> type[RuntimeFlags]:
    return flags_of(_RuntimeFlagDeclarations, names, RuntimeFlags, **dict(defaults))


RuntimeArguments = runtime_arguments()
