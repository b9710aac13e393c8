"""Merging runs into one model folder (``vlfit merge``, ``vlfit search --soup greedy``): the runs loaded and checked
(``vlfit.models.soups``), their held-out scores (``vlfit.merging.scoring``), the merge (``vlfit.merging.methods``), and
the folder saved as a run is, with ``merge.json`` saying how it was made (``vlfit.merging.folder``)."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from safetensors import safe_open

from vlfit.errors import ConfigError, ModelLoadError, first_line
from vlfit.merging.folder import claim_merge_folder, save_merged
from vlfit.merging.methods import check_method, merged_weights
from vlfit.merging.scoring import WeightsScorer, recorded_metric
from vlfit.models.soups import load_ingredients

# A weights file a run's folder holds: safetensors, or torch.save's zip archive (a pickle of old torch: not checked).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
ZIP_MAGIC = b"PK"


def check_merge_folders(runs: Sequence[str], base: str | None, output_dir: str) -> None:
    """Refuse, before anything loads, what the folders alone show: an ``--output_dir`` that is one of the models
    merged, a file, or a folder holding anything but an earlier merge; a run whose weights file is cut short.

    Raises:
        ConfigError: for the output folder.
        ModelLoadError: a weights file is incomplete (``check_weights_files``).
    """
    inputs = {os.path.realpath(name) for name in [*runs, *([base] if base else [])] if os.path.exists(name)}
    if os.path.realpath(output_dir) in inputs:
        raise ConfigError(f"--output_dir {output_dir} is one of the models merged: merge into a folder of its own")
    claim_merge_folder(output_dir)
    for name in runs:
        check_weights_files(name, "--runs")
    if base:
        check_weights_files(base, "--base")


def check_weights_files(name: str, flag: str) -> None:
    """Refuse, in one line naming the file, a weights file in the local folder ``name`` that is cut short (a copy
    or a save that stopped early): safetensors' header must cover the file, torch's zip archive must be whole.
    Reads the headers only; a hub id is left to the loader.

    Raises:
        ModelLoadError: naming ``flag``, the folder and the file.
    """
    if not os.path.isdir(name):
        return
    for entry in sorted(os.listdir(name)):
        path = os.path.join(name, entry)
        if not entry.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(path):
            continue
        reason = None
        if entry.endswith(".safetensors"):
            try:
                with safe_open(path, "pt"):
                    pass
            except Exception as error:  # safetensors' SafetensorError: the header does not match the file
                reason = f"safetensors: {first_line(error)}"
        else:
            with open(path, "rb") as f:
                is_zip = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
            if is_zip and not zipfile.is_zipfile(path):
                reason = "its zip archive has no end: torch.save did not finish it"
        if reason is not None:
            raise ModelLoadError(f"{flag} {name}: the weights file {path} is incomplete ({reason}, "
                                 f"{os.path.getsize(path):,} bytes): copy or save the run again")  # fmt: skip


@dataclass
class MergeResult:
    """What a merge made: the folder, the merged model's held-out metrics (empty without data), and the record
    written to ``merge.json``."""

    output_dir: str
    metrics: dict[str, Any]
    record: dict[str, Any]


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
    check_merge_folders(runs, base, output_dir)
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
    weights, used = merged_weights(method, ingredients, start, alpha, metric, scores, scorer, record)
    if method == "greedy":
        merged_metrics = record.pop("soup_metrics")  # evaluated as it was made
    else:
        merged_metrics = scorer.evaluate(f"the merged model ({method})", weights) if scorer is not None else {}
    record["merged"] = merged_metrics
    save_merged(ingredients[0], weights, output_dir, method, used, card_base, alpha, metric, scores, merged_metrics,
                record, command_line)  # fmt: skip
    return MergeResult(output_dir, merged_metrics, record)
