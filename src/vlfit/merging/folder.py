"""The merged folder, saved as a run is (weights, the first run's tokenizer, image processor and
``input_spec.json``), with a model card naming the method and the runs, and ``merge.json`` saying how it was made.

It is written whole or not at all (``vlfit.atomic_files.staged_folder``): staged, then moved into place with
``merge.json`` last, so a merge killed or stopped by a full disk leaves no folder that looks like a model; a folder
that holds anything but an earlier merge is refused before anything loads (``claim_merge_folder``)."""

from __future__ import annotations

import json
import os
from typing import Any

from vlfit.atomic_files import staged_folder, write_text_atomically
from vlfit.merging.scoring import RESULTS_FILE
from vlfit.model_card import MergedRuns, WiseFtMix, write_model_card
from vlfit.models.loading import build_model, save_inputs
from vlfit.models.soups import Ingredient, Weights
from vlfit.output_folders import MERGE, MERGE_RECORD

MERGE_JSON = MERGE_RECORD


def claim_merge_folder(output_dir: str) -> None:
    """Refuse, before anything loads, an ``--output_dir`` that is a file or holds anything but an earlier merge."""
    MERGE.claim(output_dir)


def save_merged(
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
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    with staged_folder(
        output_dir, MERGE.command, what="the merged model", record_name=MERGE_JSON, expected_bytes=size
    ) as staging:
        model = build_model(first.loaded.spec)
        model.load_state_dict(weights)
        model.save_pretrained(staging)
        save_inputs(first.loaded.spec, staging)
        write_model_card(
            staging,
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
        write_text_atomically(os.path.join(staging, MERGE_JSON), json.dumps(record, indent=1) + "\n")
        if merged_metrics:
            for name in ("eval_results.json", RESULTS_FILE):
                write_text_atomically(os.path.join(staging, name), json.dumps(merged_metrics, indent=1) + "\n")
