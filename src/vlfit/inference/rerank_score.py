"""What a re-ranked candidate is scored by (``--rerank_score``), and the weight a run saved for it (``rerank.json``).

``itm``: the matching head's log-odds alone, the cosine thrown away at the second stage. ``itm+itc``: the log-odds
plus ``--rerank_weight`` times the cosine, as BLIP and ALBEF re-rank with both heads. Weight 0 is ITM's order; a
very large weight is the cosine's.

The weight is the model's, like its caption length: a sweep on the run's own validation split picks it (at the end
of a training run with a matching head and a validation split, or ``vlfit eval --save_rerank_weight``) and saves it
beside the weights as ``rerank.json``; ``vlfit export`` copies it. Every door that re-ranks (``vlfit eval``,
``vlfit retrieve query``, ``vlfit serve``, ``vlfit.Index.search``) reads it through ``resolve_rerank_score``: a run
with a saved weight re-ranks by ``itm+itc`` unless told otherwise, one without by ``itm``.

    {"format_version": 1, "rerank_weight": 8.0, "split": "validation", "top_k": 16,
     "metric": "mean of t2i and i2t fused recall@1", "swept": {"0": 0.41, "1": 0.43, ...}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vlfit.errors import ConfigError, ModelLoadError
from vlfit.models.folder_record import read_folder_record, save_folder_record

RERANK_FILE = "rerank.json"
FORMAT_VERSION = 1
ITM, FUSED = "itm", "itm+itc"
RERANK_SCORES = (ITM, FUSED)
# Weights a sweep tries: 0 (ITM alone), then doubling from 1/4 to 1024. The log-odds span a few units to tens, the
# cosines of one query's top K differ by hundredths to tenths, so the weights that matter are tens to hundreds.
SWEPT_WEIGHTS = (0.0, *(2.0**power for power in range(-2, 11)))
SAVE_ADVICE = "save the run's with vlfit eval --save_rerank_weight on its validation split, or pass --rerank_weight"


@dataclass(frozen=True)
class RerankScore:
    """How a re-ranked candidate is scored: ``kind`` ``itm`` or ``itm+itc``, ``weight`` the cosine's (0 for itm)."""

    kind: str = ITM
    weight: float = 0.0

    @property
    def fused(self) -> bool:
        return self.kind == FUSED

    def __call__(self, log_odds: float, cosine: float) -> float:
        """The candidate's final score from its matching log-odds and its cosine."""
        return log_odds + self.weight * cosine if self.fused else log_odds

    def __str__(self) -> str:
        return f"itm+itc (weight {self.weight:g})" if self.fused else "itm"


ITM_ONLY = RerankScore()


def check_rerank_score(value: object, flag: str = "--rerank_score") -> str | None:
    """``value`` (None: the run's default), refused in one line naming ``flag`` unless it is itm or itm+itc."""
    if value is not None and value not in RERANK_SCORES:
        raise ConfigError(f"{flag} must be itm or itm+itc, got {value!r}")
    return value  # type: ignore[return-value]


def check_rerank_weight(value: object, flag: str = "--rerank_weight") -> float | None:
    """``value`` as a float (None: the run's saved weight), refused in one line naming ``flag`` unless it is a
    finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{flag} must be a finite number >= 0 (the cosine's weight beside the matching log-odds), "
                          f"got {value!r}")  # fmt: skip
    return float(value)


def resolve_rerank_score(
    kind: str | None,
    weight: float | None,
    saved: float | None,
    *,
    score_flag: str = "--rerank_score",
    weight_flag: str = "--rerank_weight",
) -> RerankScore:
    """The score a door re-ranks by: ``kind`` and ``weight`` as asked (None: not asked), ``saved`` the run's weight.

    Without ``kind``: ``itm+itc`` when a weight is given or saved, else ``itm``. Without ``weight``: the saved one.

    Raises:
        ConfigError: naming the flag, for a kind or weight that is not one, ``itm+itc`` with no weight given or
            saved, or a weight given with ``itm``.
    """
    kind = check_rerank_score(kind, score_flag)
    weight = check_rerank_weight(weight, weight_flag)
    if kind == ITM:
        if weight is not None:
            raise ConfigError(f"{weight_flag} weighs the cosine in {score_flag} itm+itc; drop it for {score_flag} itm")
        return ITM_ONLY
    weight = saved if weight is None else weight
    if weight is None:
        if kind == FUSED:
            raise ConfigError(f"{score_flag} itm+itc needs a weight and this model has none saved ({RERANK_FILE}): "
                              f"{SAVE_ADVICE}")  # fmt: skip
        return ITM_ONLY
    return RerankScore(FUSED, weight)


def read_rerank_file(folder: str | None) -> dict[str, Any] | None:
    """The record a model folder holds, checked; None for no folder or a folder without one.

    Raises:
        ModelLoadError: naming the file, for a record that is not JSON, of a newer format, or whose weight is not a
            finite number >= 0.
    """
    found = read_folder_record(
        folder,
        RERANK_FILE,
        format_version=FORMAT_VERSION,
        what="the saved re-ranking weight",
        remedy=f"delete the file, or {SAVE_ADVICE}",
        newer="a re-ranking record of an unknown format; upgrade vlfit to read it",
    )
    if found is None:
        return None
    path, record = found
    try:
        check_rerank_weight(record.get("rerank_weight"), "rerank_weight")
    except ConfigError as error:
        raise ModelLoadError(f"{path}: {error}; delete the file, or {SAVE_ADVICE}") from error
    if record.get("rerank_weight") is None:
        raise ModelLoadError(f"{path}: no rerank_weight; delete the file, or {SAVE_ADVICE}")
    return record


def saved_rerank_weight(folder: str | None) -> float | None:
    """The weight a model folder saved (``read_rerank_file``), None without one."""
    record = read_rerank_file(folder)
    return None if record is None else float(record["rerank_weight"])


def save_rerank_file(folder: str, record: dict[str, Any]) -> str:
    """Write ``record`` (``rerank_weight`` and how it was found) into a model folder as ``rerank.json``; its path."""
    check_rerank_weight(record.get("rerank_weight"), "rerank_weight")
    return save_folder_record(folder, RERANK_FILE, {"format_version": FORMAT_VERSION, **record})


__all__ = [
    "FUSED",
    "ITM",
    "ITM_ONLY",
    "RERANK_FILE",
    "RERANK_SCORES",
    "SWEPT_WEIGHTS",
    "RerankScore",
    "check_rerank_score",
    "check_rerank_weight",
    "read_rerank_file",
    "resolve_rerank_score",
    "save_rerank_file",
    "saved_rerank_weight",
]
