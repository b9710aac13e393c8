"""The search space: which ``vlfit train`` fields a study varies, and over what values.

A space file (``--search_space``, YAML or JSON) maps each parameter to its kind and range::

    learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}
    warmup_steps: {type: float, low: 0.0, high: 0.2}          # below 1: a fraction of the training steps
    per_device_train_batch_size: {type: categorical, choices: [16, 32, 64]}
    gradient_accumulation_steps: {type: int, low: 1, high: 4}

Any field of ``vlfit train`` (``ModelArguments``, ``DataArguments``, ``VlfitTrainingArguments``) may be searched,
``logit_scale_init_value`` (where a contrastive model's logit scale starts: the temperature) included. Every
mistake is caught here, before any data is opened, as a ``ValueError`` naming the parameter and the fix.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import yaml

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.errors import ConfigError, MissingFileError
from vlfit.training.arguments import VlfitTrainingArguments

KINDS = ("float", "int", "categorical")
# The flag that starts a contrastive model's logit scale (searched by default for models that have one).
LOGIT_SCALE_PARAMETER = "logit_scale_init_value"
# Fields a trial never changes: where its run goes, what it runs, and the split its metric is measured on.
NOT_SEARCHABLE = frozenset(
    {"output_dir", "resume_from_checkpoint", "do_train", "do_eval", "do_predict", "eval_split", "seed"}
)


@dataclass(frozen=True)
class Parameter:
    """One searched parameter.

    Attributes:
        name: The ``vlfit train`` field.
        kind: ``float``, ``int`` or ``categorical``.
        low: Lowest value (``float`` and ``int``).
        high: Highest value, included (``float`` and ``int``).
        log: Sample on a log scale (``float`` and ``int``; needs ``low > 0``).
        step: Spacing of the values (``int``; ``float`` without ``log``).
        choices: The values (``categorical``).
    """

    name: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        """The value ``trial`` (an ``optuna.Trial``, or a ``FixedTrial`` on the other processes) takes."""
        if self.kind == "float":
            return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.name, list(self.choices))

    def to_dict(self) -> dict[str, Any]:
        """The parameter as a space file writes it."""
        if self.kind == "categorical":
            return {"type": self.kind, "choices": list(self.choices)}
        out: dict[str, Any] = {"type": self.kind, "low": self.low, "high": self.high}
        if self.log:
            out["log"] = True
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclass(frozen=True)
class SearchSpace:
    """The parameters of a study, in the order the file lists them."""

    parameters: tuple[Parameter, ...]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parameters]

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Every parameter's value for ``trial``."""
        return {p.name: p.suggest(trial) for p in self.parameters}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {p.name: p.to_dict() for p in self.parameters}

    def fingerprint(self) -> str:
        """A canonical JSON form, stored with the study so a resumed study is known to search the same space."""
        return json.dumps(self.to_dict(), sort_keys=True)


def train_fields() -> dict[str, Any]:
    """Every ``vlfit train`` field by name, with its dataclass field (for its type)."""
    found: dict[str, Any] = {}
    for cls in (ModelArguments, DataArguments, VlfitTrainingArguments):
        for f in fields(cls):
            if f.init:
                found.setdefault(f.name, f)
    return found


def searchable_names() -> list[str]:
    """The names a space may use, sorted."""
    return sorted(name for name in train_fields() if name not in NOT_SEARCHABLE and not name.startswith("_"))


def default_space(contrastive: bool) -> SearchSpace:
    """The space searched without ``--search_space``: learning rate, warmup, weight decay, and for contrastive
    models the initial logit scale (``ln(1/0.07) = 2.66`` by default; ``ln 5`` to ``ln 100`` here)."""
    parameters = [
        Parameter("learning_rate", "float", 1e-5, 1e-3, log=True),
        Parameter("warmup_steps", "float", 0.0, 0.2),  # transformers 5: a value below 1 is a ratio of the steps
        Parameter("weight_decay", "float", 0.0, 0.1),
    ]
    if contrastive:
        parameters.append(Parameter(LOGIT_SCALE_PARAMETER, "float", round(math.log(5), 4), round(math.log(100), 4)))
    return SearchSpace(tuple(parameters))


def load_space(path: str) -> SearchSpace:
    """Read and check a space file.

    Args:
        path: A ``.yaml``/``.yml`` or ``.json`` file mapping parameter names to ``{type, low, high, log, step}``
            or ``{type: categorical, choices}``.

    Raises:
        FileNotFoundError: No such file.
        ValueError: The file is not a mapping, or a parameter is unknown, has no kind, an empty or inverted range,
            a log range through 0 or empty choices.
    """
    if not os.path.isfile(path):
        raise MissingFileError(f"--search_space {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise ConfigError(f"--search_space {path}: not valid {kind}: {err}") from None
    if not isinstance(values, dict) or not values:
        raise ConfigError(f"--search_space {path}: expected a mapping of parameter names to their ranges")
    return parse_space(values, source=path)


def parse_space(values: dict[str, Any], *, source: str = "search space") -> SearchSpace:
    """Check a space given as ``{name: {type, ...}}`` (what ``load_space`` reads); see there.

    Whether the model has a logit scale for ``logit_scale_init_value`` is checked once the model is built.
    """
    known = train_fields()
    valid = searchable_names()
    parameters = []
    for name, spec in values.items():
        where = f"{source}: {name}"
        if name not in valid:
            raise ConfigError(f"{where}: {_unknown(name, valid)}")
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{type: float, low: 0.0, high: 1.0}}")
        parameters.append(_parameter(name, spec, where, known[name]))
    return SearchSpace(tuple(parameters))


def _unknown(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    if name in NOT_SEARCHABLE:
        return f"cannot be searched (every trial shares it); searchable: {', '.join(valid)}"
    return f"not a vlfit train field{hint}; searchable: {', '.join(valid)}"


def _number(value: Any, key: str, where: str) -> float:
    # PyYAML reads 1e-5 (no dot) as a string: accept numbers written either way.
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}") from None


def _parameter(name: str, spec: dict[str, Any], where: str, field_: Any) -> Parameter:
    allowed = {"type", "low", "high", "log", "step", "choices"}
    extra = sorted(set(spec) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key {', '.join(extra)}; a parameter has: {', '.join(sorted(allowed))}")
    kind = spec.get("type")
    if kind not in KINDS:
        raise ConfigError(f"{where}: type must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: categorical needs a non-empty list of choices")
        if set(spec) - {"type", "choices"}:
            raise ConfigError(f"{where}: categorical takes only choices")
        return Parameter(name, kind, choices=tuple(choices))
    if "choices" in spec:
        raise ConfigError(f"{where}: choices are for type categorical; a {kind} has low and high")
    if "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where}: a {kind} parameter needs low and high")
    low, high = _number(spec["low"], "low", where), _number(spec["high"], "high", where)
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log must be true or false, got {log!r}")
    step = None if spec.get("step") is None else _number(spec["step"], "step", where)
    if kind == "int":
        if any(v != int(v) for v in (low, high, step or 1)):
            raise ConfigError(f"{where}: an int parameter needs whole low, high and step")
        low, high, step = int(low), int(high), None if step is None else int(step)
        if not _types(field_) & {"int", "float"}:
            raise ConfigError(f"{where}: the field is not a number; use type categorical")
    elif "float" not in _types(field_):
        raise ConfigError(f"{where}: the field is not a float; use type int or categorical")
    if low >= high:
        raise ConfigError(f"{where}: empty or inverted range: low {low} must be below high {high}")
    if log and low <= 0:
        raise ConfigError(f"{where}: a log range must stay above 0, got low {low}; raise low or drop log")
    if step is not None and (step <= 0 or (log and kind == "float")):
        raise ConfigError(f"{where}: step must be positive, and a float log range takes no step")
    return Parameter(name, kind, low, high, log=log, step=step)


def _types(field_: Any) -> set[str]:
    """The type names a dataclass field's annotation admits (``{"int"}`` for ``int | None``)."""
    annotation = field_.type if isinstance(field_.type, str) else getattr(field_.type, "__name__", str(field_.type))
    for sep in "|,[]":
        annotation = annotation.replace(sep, " ")
    return {word.rpartition(".")[2] for word in annotation.split()}


def describe(space: SearchSpace, names: Iterable[str] | None = None) -> str:
    """One line per parameter, for the log."""
    wanted = set(names) if names is not None else None
    lines = []
    for p in space.parameters:
        if wanted is not None and p.name not in wanted:
            continue
        if p.kind == "categorical":
            lines.append(f"{p.name}: one of {list(p.choices)}")
        else:
            lines.append(f"{p.name}: {p.kind} in [{p.low}, {p.high}]{' (log)' if p.log else ''}")
    return "; ".join(lines)
