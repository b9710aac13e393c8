"""``--hard_negative_column``: training scores each image against its caption's alternatives too."""

from __future__ import annotations

import json

import pytest

from tests.training.train_runs import logged_losses, tiny_train_argv
from vlfit.cli import main

pytestmark = pytest.mark.slow


def test_training_with_hard_negatives_changes_the_loss_and_counts_their_text_passes(tmp_path, synthetic_dataset_dir):
    runs = {}
    for name, extra in (("plain", []), ("hard", ["--hard_negative_column", "caption_choices"])):
        out = tmp_path / name
        argv = tiny_train_argv(synthetic_dataset_dir, out, "--save_strategy", "no", *extra, steps=2)
        assert main(["train", *argv]) == 0
        runs[name] = (logged_losses(out), json.loads((out / "train_results.json").read_text()))
    (plain_losses, plain), (hard_losses, hard) = runs["plain"], runs["hard"]
    assert plain_losses.keys() == hard_losses.keys() == {1, 2}
    # Same data, seed and weights: the first step's loss differs only by the hard-negative term.
    assert abs(hard_losses[1] - plain_losses[1]) > 1e-3
    # Four alternatives per caption go through the text tower (forward and backward) on every step.
    assert hard["train_flops_per_sample"] > plain["train_flops_per_sample"] * 1.05
