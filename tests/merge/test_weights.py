"""The weight arithmetic of ``vlfit.models.soups``: a uniform soup is the mean, a soup of one run twice is the run,
Model Stock's ratio is ``N cos / (1 + (N - 1) cos)`` per tensor, a greedy soup leaves out a run that makes the
held-out score drop."""

from __future__ import annotations

import pytest
import torch

from vlfit.models.soups import greedy_soup, mean_pairwise_cosine, model_stock, stock_ratio, uniform_soup


def test_a_uniform_soup_of_two_runs_is_their_mean() -> None:
    a = {"w": torch.tensor([0.0, 2.0]), "ids": torch.arange(2), "half": torch.ones(2, dtype=torch.float16)}
    b = {"w": torch.tensor([4.0, -2.0]), "ids": torch.arange(2), "half": torch.zeros(2, dtype=torch.float16)}
    soup = uniform_soup([a, b])
    assert soup["w"].tolist() == [2.0, 0.0]
    assert torch.equal(soup["ids"], a["ids"])
    assert soup["half"].dtype == torch.float16 and soup["half"].tolist() == [0.5, 0.5]


def test_merging_a_run_with_itself_gives_the_run() -> None:
    run = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    base = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    assert all(torch.equal(uniform_soup([run, run])[name], run[name]) for name in run)
    stock, ratios = model_stock(base, [run, run])  # identical changes: cos 1, t 1, the runs' mean
    assert ratios == {name: pytest.approx(1.0, abs=1e-6) for name in run}  # a float32 cosine of a vector with itself
    assert all(torch.allclose(stock[name], run[name]) for name in run)


def test_model_stock_on_orthogonal_changes_is_the_base_and_follows_the_formula_between() -> None:
    base = {"w": torch.tensor([1.0, 1.0, 1.0])}
    orthogonal = [{"w": base["w"] + torch.tensor([1.0, 0.0, 0.0])}, {"w": base["w"] + torch.tensor([0.0, 2.0, 0.0])}]
    merged, ratios = model_stock(base, orthogonal)
    assert ratios == {"w": 0.0} and torch.equal(merged["w"], base["w"])

    # 60 degrees apart: cos 0.5, t = 2 x 0.5 / (1 + 0.5) = 2/3 of the way from the base to the runs' mean.
    runs = [{"w": base["w"] + torch.tensor([1.0, 0.0, 0.0])}, {"w": base["w"] + torch.tensor([0.5, 3**0.5 / 2, 0.0])}]
    assert mean_pairwise_cosine([run["w"] - base["w"] for run in runs]) == pytest.approx(0.5)
    merged, ratios = model_stock(base, runs)
    assert ratios["w"] == pytest.approx(2 / 3)
    mean = (runs[0]["w"] + runs[1]["w"]) / 2
    assert torch.allclose(merged["w"], base["w"] + 2 / 3 * (mean - base["w"]))
    assert stock_ratio(0.5, 3) == pytest.approx(1.5 / 2) and stock_ratio(-0.4, 3) == 0.0  # clipped at 0


def test_a_greedy_soup_leaves_out_a_run_that_makes_the_held_out_score_drop() -> None:
    target = torch.ones(4)
    good, close, broken = {"w": target * 0.9}, {"w": target * 1.1}, {"w": target * 25.0}

    def score(label: str, weights: dict[str, torch.Tensor]) -> float:
        return -float((weights["w"] - target).abs().mean())

    runs = [("broken", broken, -24.0), ("close", close, -0.1), ("good", good, -0.1)]
    soup = greedy_soup(runs, score)
    assert [step.run for step in soup.steps] == ["close", "good", "broken"]  # by score, ties in the order given
    assert soup.kept == ["close", "good"] and [step.kept for step in soup.steps] == [True, True, False]
    assert torch.allclose(soup.weights["w"], target) and soup.score == pytest.approx(0.0)
