"""``vlfit search --soup greedy``: the study ends with a greedy soup of its best trials in ``<output_dir>/soup``, whose
order and steps follow the trials' metric, whose score is at least the best trial's, and whose ingredients keep
their weights; ``vlfit merge --search_dir`` merges the same trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import BridgeTowerForContrastiveLearning

from tests.search.search_runs import load_trials, search_argv, write_space
from vlfit.cli import main

pytestmark = pytest.mark.slow

METRIC = "eval_t2i_recall@1"


def test_a_study_ends_with_a_greedy_soup_of_its_best_trials(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    out = tmp_path / "search"
    argv = search_argv(synthetic_dataset_dir, out, write_space(tmp_path), "--n_trials", "3", "--pruner", "none",
                       "--soup", "greedy", "--soup_top_k", "2")  # fmt: skip
    assert main(["search", *argv]) == 0

    trials = sorted(load_trials(out), key=lambda t: (-t.value, t.number))
    top = [str(out / f"trial-{t.number}") for t in trials[:2]]
    record = json.loads((out / "soup" / "merge.json").read_text())
    assert record["method"] == "greedy" and [step["run"] for step in record["steps"]] == top
    assert record["merged"][METRIC] >= record["steps"][0]["soup_score"]
    assert all((Path(run) / "model.safetensors").exists() for run in top)  # the ingredients keep their weights
    assert not (out / f"trial-{trials[2].number}" / "model.safetensors").exists()
    BridgeTowerForContrastiveLearning.from_pretrained(out / "soup")

    merged = tmp_path / "uniform"
    assert main(["merge", "--method", "uniform", "--search_dir", str(out), "--top_k", "2", "--output_dir",
                 str(merged)]) == 0  # fmt: skip
    assert [run["run"] for run in json.loads((merged / "merge.json").read_text())["runs"]] == top
