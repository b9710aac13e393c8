"""A study's trials as the runs of a merge (``vlfit.merging``): the folders of its best complete trials (``vlfit merge
--search_dir``), and the soup that ends a study (``vlfit search --soup``), judged on the study's evaluation split."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from vlfit.errors import ConfigError, MissingFileError
from vlfit.merging.runs import MergeResult, merge_runs
from vlfit.merging.scoring import WeightsScorer
from vlfit.search.report import SEARCH_JSON

SOUP_DIR = "soup"  # where vlfit search --soup saves its soup


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
