"""The merge methods: what each needs (refused before anything loads), and the merged weights each makes from the
loaded runs (the weight arithmetic is ``vlfit.models.soups``'s and ``vlfit.models.interpolation``'s)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vlfit.errors import ConfigError
from vlfit.merging.scoring import WeightsScorer
from vlfit.models.interpolation import interpolate
from vlfit.models.soups import Ingredient, Weights, greedy_soup, model_stock, uniform_soup

logger = logging.getLogger(__name__)

METHODS = ("wise", "uniform", "greedy", "stock")


def check_method(method: str, runs: int, base: str | None, scored: bool) -> None:
    """Refuse a method without what it needs, before anything loads."""
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    if method in ("wise", "stock") and not base:
        what = "the model the run was fine-tuned from" if method == "wise" else "the runs' common starting model"
        raise ConfigError(f"--method {method!r} needs --base: {what}")
    if method == "wise" and runs != 1:
        raise ConfigError(f"--method 'wise' mixes one run with --base; --runs names {runs} (merge them first, e.g. "
                          "--method 'greedy', and mix that soup with its base)")  # fmt: skip
    if method == "stock" and runs < 2:
        raise ConfigError(f"--method 'stock' needs at least two --runs (the angle between their changes), got {runs}")
    if method == "greedy" and not scored:
        raise ConfigError(
            "--method 'greedy' keeps a run only when the soup's held-out score does not drop: pass the held-out data, "
            "--validation_file FILE or --dataset_name DATA (its --eval_split, default validation)"
        )


def merged_weights(
    method: str,
    ingredients: list[Ingredient],
    start: Ingredient | None,
    alpha: float,
    metric: str,
    scores: dict[str, dict[str, Any]],
    scorer: WeightsScorer | None,
    record: dict[str, Any],
) -> tuple[Weights, list[str]]:
    """The merged weights, and the runs in them; adds what the method decided to ``record``."""
    names = [ingredient.name for ingredient in ingredients]
    if method == "wise":
        assert start is not None
        record["alpha"] = alpha
        return interpolate(start.weights, ingredients[0].weights, alpha), names
    if method == "uniform":
        return uniform_soup([ingredient.weights for ingredient in ingredients]), names
    if method == "stock":
        assert start is not None
        weights, ratios = model_stock(start.weights, [ingredient.weights for ingredient in ingredients])
        values = list(ratios.values())
        record["ratio"] = {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}
        record["ratios"] = ratios
        logger.info("Model Stock: per-tensor ratio t from %.3f to %.3f (mean %.3f) between the base and the runs' mean",
                    min(values), max(values), sum(values) / len(values))  # fmt: skip
        return weights, names
    assert scorer is not None
    evaluated: list[dict[str, Any]] = []  # each candidate soup's metrics, in order

    def score(label: str, candidate: Weights) -> float:
        evaluated.append(scorer.evaluate(label, candidate))
        return float(evaluated[-1][metric])

    soup = greedy_soup([(i.name, i.weights, float(scores[i.name][metric])) for i in ingredients], score)
    record["steps"] = [dataclasses.asdict(step) for step in soup.steps]
    record["kept"] = soup.kept
    # The soup's metrics: those of the last candidate kept (the best run's own when no other was).
    kept = [metrics for step, metrics in zip(soup.steps[1:], evaluated, strict=True) if step.kept]
    record["soup_metrics"] = kept[-1] if kept else scores[soup.kept[0]]
    return soup.weights, soup.kept
