"""Merging runs into one model folder (``vlfit merge``, ``vlfit search --soup greedy``): the runs loaded and checked
(``vlfit.models.soups``), their held-out scores, the merge, and the folder saved as a run is (weights, tokenizer,
image processor, ``input_spec.json``, model card), with ``merge.json`` saying how it was made.

A held-out score is what ``vlfit eval`` reports on the evaluation split (``--eval_split`` of the data flags), through
the same ``run()`` and Trainer: ``WeightsScorer`` builds the model once per candidate from the first run's folder
and loads the candidate's weights into it, as ``vlfit wise-ft`` evaluates its mixes.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.atomic_files import write_text_atomically
from vlfit.errors import ConfigError, MissingFileError
from vlfit.model_card import MergedRuns, WiseFtMix, write_model_card
from vlfit.models.interpolation import interpolate
from vlfit.models.loading import build_model, save_inputs
from vlfit.models.soups import Ingredient, Weights, greedy_soup, load_ingredients, model_stock, uniform_soup
from vlfit.search.report import SEARCH_JSON
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.run import run, setup_run

logger = logging.getLogger(__name__)

METHODS = ("wise", "uniform", "greedy", "stock")
MERGE_JSON = "merge.json"
SOUP_DIR = "soup"  # where vlfit search --soup saves its soup
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


@dataclass
class MergeResult:
    """What a merge made: the folder, the merged model's held-out metrics (empty without data), and the record
    written to ``merge.json``."""

    output_dir: str
    metrics: dict[str, Any]
    record: dict[str, Any]


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


def merge_runs(
    runs: Sequence[str],
    *,
    method: str,
    output_dir: str,
    base: str | None = None,
    alpha: float = 0.5,
    metric: str = "eval_t2i_recall@1",
    scorer: WeightsScorer | None = None,
    max_seq_length: int | None = None,
    command_line: str | None = None,
) -> MergeResult:
    """Merge ``runs`` by ``method`` into ``output_dir``, a model folder every vlfit door and plain transformers
    load.

    Args:
        runs: The runs (checkpoint folders, LoRA adapters of one base, hub ids).
        method: ``wise`` (``(1 - alpha) base + alpha run``), ``uniform``, ``greedy`` or ``stock``.
        output_dir: The merged model's folder.
        base: The model the runs were fine-tuned from (``wise`` and ``stock`` need it; otherwise it is checked and
            named in the card).
        alpha: The run's weight in the ``wise`` mix.
        metric: The held-out score the runs are ranked and the greedy soup judged by.
        scorer: Evaluates weights on the held-out data; None: no evaluation (``greedy`` needs one).
        max_seq_length: The caption length to load every run at (None: each run's own, which must agree).
        command_line: The command, for the model card.
    """
    check_method(method, len(runs), base, scorer is not None)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"--alpha {alpha} is outside [0, 1]")
    inputs = {os.path.realpath(name) for name in [*runs, *([base] if base else [])] if os.path.exists(name)}
    if os.path.realpath(output_dir) in inputs:
        raise ConfigError(f"--output_dir {output_dir} is one of the models merged: merge into a folder of its own")
    ingredients, start = load_ingredients(runs, base, max_seq_length=max_seq_length)
    recorded = {ingredient.base for ingredient in ingredients if ingredient.base}
    card_base = base or (recorded.pop() if len(recorded) == 1 else None)  # the card names the runs' base
    scores: dict[str, dict[str, Any]] = {}
    for ingredient in ingredients:
        if scorer is not None:
            scores[ingredient.name] = scorer.evaluate(f"the run {ingredient.name}", ingredient.weights)
        elif (value := recorded_metric(ingredient.name, metric)) is not None:
            scores[ingredient.name] = {metric: value}
    record: dict[str, Any] = {
        "method": method,
        "base": base,
        "metric": metric,
        "scored_on_held_out_data": scorer is not None,
    }
    record["runs"] = [{"run": i.name, metric: scores.get(i.name, {}).get(metric)} for i in ingredients]
    weights, used = _merge(method, ingredients, start, alpha, metric, scores, scorer, record)
    if method == "greedy":
        merged_metrics = record.pop("soup_metrics")  # evaluated as it was made
    else:
        merged_metrics = scorer.evaluate(f"the merged model ({method})", weights) if scorer is not None else {}
    record["merged"] = merged_metrics
    _save(ingredients[0], weights, output_dir, method, used, card_base, alpha, metric, scores, merged_metrics, record,
          command_line)  # fmt: skip
    return MergeResult(output_dir, merged_metrics, record)


def _merge(
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


def _save(
    first: Ingredient,
    weights: Weights,
    output_dir: str,
    method: str,
    used: list[str],
    base: str | None,
    alpha: float,
    metric: str,
    scores: dict[str, dict[str, Any]],
    merged_metrics: dict[str, Any],
    record: dict[str, Any],
    command_line: str | None,
) -> None:
    """The folder: weights, the first run's tokenizer, image processor and input settings, card, ``merge.json``."""
    spec = first.loaded.spec
    model = build_model(spec)
    model.load_state_dict(weights)
    model.save_pretrained(output_dir)
    save_inputs(spec, output_dir)
    inputs = "; ".join(
        f"`{name}` {metric} {scores[name][metric]:.4f}" if name in scores else f"`{name}` (no {metric} recorded)"
        for name in [ingredient["run"] for ingredient in record["runs"]]
    )
    where = "on the held-out split below" if record["scored_on_held_out_data"] else "as each run recorded it"
    how = f"Made by `vlfit merge --method {method}` from {len(record['runs'])} run(s), scored {where}: {inputs}."
    if method == "greedy":
        how += " In order, the soup's score with each run: " + ", ".join(
            f"`{step['run']}` {step['soup_score']:.4f} ({'kept' if step['kept'] else 'left out'})"
            for step in record["steps"]
        ) + "."  # fmt: skip
    if method == "stock":
        how += (f" Model Stock's ratio t per tensor: {record['ratio']['min']:.3f} to {record['ratio']['max']:.3f} "
                f"(mean {record['ratio']['mean']:.3f}).")  # fmt: skip
    write_model_card(
        output_dir,
        family_name=first.loaded.family.name,
        base_model=base,
        preset=None,
        datasets=[],  # the runs' cards name their training data; the merge was only evaluated
        metrics=merged_metrics,
        command_line=command_line,
        how_made=how,
        mix=WiseFtMix(alpha, zeroshot_model=base, finetuned_model=used[0]) if method == "wise" else None,
        merged=None if method == "wise" else MergedRuns(method, tuple(used), base),
    )
    write_text_atomically(os.path.join(output_dir, MERGE_JSON), json.dumps(record, indent=1) + "\n")
    if merged_metrics:
        for name in ("eval_results.json", RESULTS_FILE):
            write_text_atomically(os.path.join(output_dir, name), json.dumps(merged_metrics, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------ a study's trials


def study_runs(search_dir: str, top_k: int) -> tuple[list[str], str | None]:
    """The run folders of the ``top_k`` best complete trials of the ``vlfit search`` study in ``search_dir`` (best
    first), and the model the study fine-tuned (its ``--model_name_or_path``; None for a preset).

    Raises:
        MissingFileError: no ``search.json`` there.
        ConfigError: no complete trial, or a chosen trial whose weights were removed.
    """
    path = os.path.join(search_dir, SEARCH_JSON)
    if not os.path.isfile(path):
        raise MissingFileError(f"--search_dir {search_dir}: no {SEARCH_JSON} (the folder a vlfit search wrote)")
    if top_k < 1:
        raise ConfigError(f"--top_k must be at least 1, got {top_k}")
    with open(path, encoding="utf-8") as f:
        study = json.load(f)
    complete = [
        trial
        for trial in study.get("trials", [])
        if trial.get("state") == "complete" and trial.get("value") is not None
    ]
    if not complete:
        raise ConfigError(f"--search_dir {search_dir}: the study has no complete trial yet")
    maximize = study.get("direction", "maximize") == "maximize"
    complete.sort(key=lambda trial: -trial["value"] if maximize else trial["value"])
    chosen = complete[:top_k]
    for trial in chosen:
        if not _has_weights(trial["run_dir"]):
            raise ConfigError(
                f"--search_dir {search_dir}: trial {trial['number']} ({trial['run_dir']}) has no weights left (vlfit "
                "search keeps only the best trial's unless --keep_trial_checkpoints or --soup); pass a smaller --top_k"
            )
    best_yaml = os.path.join(search_dir, "best.yaml")
    base = None
    if os.path.isfile(best_yaml):
        import yaml

        with open(best_yaml, encoding="utf-8") as f:
            base = (yaml.safe_load(f) or {}).get("model_name_or_path")
    return [trial["run_dir"] for trial in chosen], base


def _has_weights(folder: str) -> bool:
    return bool(glob.glob(os.path.join(folder, "*.safetensors")) or glob.glob(os.path.join(folder, "*.bin")))


def soup_of_trials(
    runs: Sequence[str],
    base_flags: dict[str, Any],
    metric: str,
    output_dir: str,
    *,
    method: str = "greedy",
    command_line: str | None = None,
) -> MergeResult:
    """The soup of a study's trial runs (best first), judged on the study's evaluation split (``vlfit search
    --soup``)."""
    with tempfile.TemporaryDirectory(prefix="vlfit-soup-") as scratch:
        scorer = trial_scorer(base_flags, runs[0], scratch, metric)
        base = base_flags.get("model_name_or_path")
        return merge_runs(runs, method=method, output_dir=output_dir, base=str(base) if base else None,
                          metric=metric, scorer=scorer, command_line=command_line)  # fmt: skip


def trial_scorer(base_flags: dict[str, Any], first_run: str, scratch: str, metric: str) -> WeightsScorer:
    """A scorer of a study's trials: the study's data and evaluation settings, the model built from ``first_run``
    (a trial's folder, with every tensor the trials have)."""
    from vlfit.search.objective import parse_train_values

    model, data, training = parse_train_values({**base_flags, "output_dir": scratch, "report_to": "none"})
    # The trial's own folder, whole: its tokenizer and image processor, its weights merged, no new adapters.
    model = dataclasses.replace(model, model_name_or_path=first_run, model_preset=None, tokenizer_name=None,
                                config_name=None, image_processor_name=None, lora_r=None)  # fmt: skip
    return WeightsScorer(model, data, training, metric)
