"""The held-out scores a merge ranks its runs by and judges a greedy soup by.

A held-out score is what ``vlfit eval`` reports on the evaluation split (``--eval_split`` of the data flags), through
the same ``run()`` and Trainer: ``WeightsScorer`` builds the model once per candidate from the first run's folder
and loads the candidate's weights into it, as ``vlfit wise-ft`` evaluates its mixes. Without held-out data, a run's
score is the one its own final evaluation recorded (``recorded_metric``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.errors import ConfigError
from vlfit.models.soups import Weights
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.run import run, setup_run

# What vlfit train leaves beside a run's weights: its final metrics.
RESULTS_FILE = "all_results.json"


class WeightsScorer:
    """Evaluates weights on the held-out split as ``vlfit eval`` does (one ``setup_run`` for every candidate).

    Args:
        model: The model flags of the first run (its folder: the model every candidate's weights load into).
        data: The data flags (the evaluation split is ``--eval_split``).
        training: Evaluation-only run settings; each candidate writes its ``eval_results.json`` under
            ``training.output_dir``.
        metric: The score (``eval_t2i_recall@1`` ...).
    """

    def __init__(
        self, model: ModelArguments, data: DataArguments, training: VlfitTrainingArguments, metric: str
    ) -> None:
        self.model, self.data, self.metric = model, data, metric
        self.training = dataclasses.replace(training, do_train=False, do_eval=True)
        self.setup = setup_run(model, data, self.training)
        self.evaluated = 0

    def evaluate(self, label: str, weights: Weights) -> dict[str, Any]:
        """The metrics of ``weights`` on the held-out split."""
        self.evaluated += 1
        print(f"\nvlfit merge: evaluating {label}", flush=True)  # each evaluation prints its table: say which first
        output_dir = os.path.join(self.training.output_dir, f"evaluation-{self.evaluated}")
        training = dataclasses.replace(self.training, output_dir=output_dir)
        metrics = run(self.model, self.data, training, setup=self.setup, state_dict=weights)
        if self.metric not in metrics:
            scores = sorted(key for key in metrics if key.startswith("eval_") and isinstance(metrics[key], float))
            raise ConfigError(f"--metric {self.metric}: the evaluation reports no such metric; it reports "
                              f"{', '.join(scores)}")  # fmt: skip
        return {key: value for key, value in metrics.items() if key.startswith("eval_")}

    def score(self, label: str, weights: Weights) -> float:
        return float(self.evaluate(label, weights)[self.metric])


def recorded_metric(folder: str, metric: str) -> float | None:
    """``metric`` as the run's own final evaluation recorded it (``all_results.json``), or None."""
    path = os.path.join(folder, RESULTS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get(metric)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
