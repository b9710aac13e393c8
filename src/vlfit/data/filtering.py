"""What ``vlfit filter`` keeps of a split: the cut (``Cut``: the lowest fraction of the scores, or those below a
score), a histogram of the scores with the cut marked, and the report.

The kept rows are written with their score as a column by ``vlfit.data.split_copy``; scoring is
``vlfit.inference.pair_scores``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlfit.errors import ConfigError

DEFAULT_SCORE_COLUMN = "clip_score"
HISTOGRAM_NAME = "scores.png"


@dataclass(frozen=True)
class Cut:
    """Which pairs a filter drops: the lowest ``drop_fraction`` of a split's scores, or those below ``min_score``
    (exactly one of the two).

    Raises:
        ConfigError: for both or neither, or a fraction outside (0, 1), naming the flags.
    """

    drop_fraction: float | None = None
    min_score: float | None = None

    def __post_init__(self) -> None:
        if (self.drop_fraction is None) == (self.min_score is None):
            raise ConfigError("give exactly one of --drop_fraction (e.g. 0.3) and --min_score (e.g. 0.25)")
        if self.drop_fraction is not None and not 0.0 < self.drop_fraction < 1.0:
            raise ConfigError(f"--drop_fraction must be between 0 and 1 (exclusive), not {self.drop_fraction}")
        if self.min_score is not None and not math.isfinite(self.min_score):
            raise ConfigError(f"--min_score must be a number, not {self.min_score}")

    def keep(self, scores: np.ndarray) -> np.ndarray:
        """A mask of the scores kept: all but the ``round(n * drop_fraction)`` lowest (ties broken by row order, the
        earlier row dropped first), or those at or above ``min_score``."""
        if self.min_score is not None:
            return scores >= self.min_score
        kept = np.ones(len(scores), dtype=bool)
        kept[np.argsort(scores, kind="stable")[: round(len(scores) * self.drop_fraction)]] = False
        return kept

    def to_dict(self) -> dict[str, float]:
        return {"drop_fraction": self.drop_fraction} if self.min_score is None else {"min_score": self.min_score}


@dataclass(frozen=True)
class FilteredSplit:
    """One split's outcome: rows read, scored (the others were bad samples), kept and dropped, and the scores."""

    split: str
    read: int
    scores: np.ndarray
    kept: np.ndarray
    bad_samples: int

    @property
    def threshold(self) -> float | None:
        """The lowest score kept (None when nothing was)."""
        return float(self.scores[self.kept].min()) if self.kept.any() else None

    def to_dict(self) -> dict[str, Any]:
        kept = int(self.kept.sum())
        figures = {"read": self.read, "scored": len(self.scores), "kept": kept, "dropped": len(self.scores) - kept,
                   "bad_samples": self.bad_samples, "lowest_kept_score": self.threshold}  # fmt: skip
        if len(self.scores):
            figures |= {"mean_score": float(self.scores.mean()), "median_score": float(np.median(self.scores))}
        return figures


def write_histogram(path: str, splits: Sequence[FilteredSplit], cut: Cut, model: str) -> None:
    """A histogram of each split's scores (one panel each), kept and dropped in two colours, the cut a line."""
    import matplotlib  # here, not at import: choosing the backend is a process-wide setting, and it takes a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(splits), 1), figsize=(5.2 * max(len(splits), 1), 4.0), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=False):
        scores = split.scores
        bins = np.histogram_bin_edges(scores, bins=40) if len(scores) else 10
        ax.hist(scores[split.kept], bins=bins, color="tab:blue", label=f"kept {int(split.kept.sum())}")
        ax.hist(scores[~split.kept], bins=bins, color="tab:red", label=f"dropped {int((~split.kept).sum())}")
        line = cut.min_score if cut.min_score is not None else split.threshold
        if line is not None:
            ax.axvline(line, color="black", linestyle="--", linewidth=1, label=f"cut {line:.3f}")
        ax.set_xlabel("cosine of the pair's image and caption embeddings")
        ax.set_ylabel("pairs")
        ax.set_title(f"{split.split}: {len(scores)} pairs scored")
        ax.legend(fontsize=7)
    rule = f"lowest {cut.drop_fraction:.0%} dropped" if cut.min_score is None else f"below {cut.min_score} dropped"
    fig.suptitle(f"vlfit filter: {rule}, scored by {model}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def filter_report(splits: Sequence[FilteredSplit], cut: Cut, model: Mapping[str, Any], score_column: str) -> str:
    """The JSON report: the model, the cut, and per split what was read, scored, kept and dropped."""
    totals = {key: sum(s.to_dict()[key] for s in splits) for key in ("read", "kept", "dropped", "bad_samples")}
    report = {"model": dict(model), "cut": cut.to_dict(), "score_column": score_column, **totals,
              "splits": {s.split: s.to_dict() for s in splits}, "histogram": HISTOGRAM_NAME}  # fmt: skip
    return json.dumps(report, indent=1) + "\n"
