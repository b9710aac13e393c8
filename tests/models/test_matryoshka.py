"""Matryoshka training (``--matryoshka_dims``): the loss is the weighted mean of the family's own loss at the full size
and at each prefix (``--matryoshka_prefix_weight``), cut and normalised again; gradient caching gives the same; the
run records its sizes where every door reads them, and sizes the model cannot hold are refused before training."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.test_dual_encoders import _inputs
from tests.training.test_gradient_cache import FAMILIES, _grads, _model
from tests.training.train_runs import single_torch_thread, tiny_train_argv
from vlfit.errors import ConfigError
from vlfit.models.family import LossEmbeddings, LossScope
from vlfit.models.matryoshka import DEFAULT_PREFIX_WEIGHT, MatryoshkaLoss, prefix_embeddings
from vlfit.training.gradient_cache import gradient_cached_backward


def test_a_prefix_cuts_and_normalises_the_embeddings_only():
    rows = {"text": torch.nn.functional.normalize(torch.randn(4, 8), dim=-1), "image": torch.randn(4, 8),
            "hard_negative_valid": torch.ones(4, 2, dtype=torch.bool), "image_keys": torch.arange(4)}  # fmt: skip
    cut = prefix_embeddings(LossEmbeddings(rows, {"logit_scale": torch.tensor(3.0)}), 3)
    assert cut.rows["text"].shape == (4, 3) and cut.rows["image"].shape == (4, 3)
    torch.testing.assert_close(cut.rows["text"].norm(dim=-1), torch.ones(4))
    torch.testing.assert_close(cut.rows["text"], torch.nn.functional.normalize(rows["text"][:, :3], dim=-1))
    assert (
        cut.rows["hard_negative_valid"] is rows["hard_negative_valid"] and cut.rows["image_keys"] is rows["image_keys"]
    )


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_loss_is_the_weighted_mean_of_the_familys_loss_at_each_size(preset):
    family, model, inputs = FAMILIES[preset], _model(preset), _inputs(hard_negatives=True)
    with torch.no_grad():
        embeddings = family.loss_embeddings(model, inputs)
        full = family.loss_from_embeddings(embeddings)
        prefixes = [family.loss_from_embeddings(prefix_embeddings(embeddings, size)) for size in (4, 8)]
        weighted = MatryoshkaLoss(family, [8, 4]).contrastive_loss(model, inputs)  # the default weight, 0.1
        plain_mean = MatryoshkaLoss(family, [8, 4], prefix_weight=1.0).contrastive_loss(model, inputs)
    torch.testing.assert_close(
        weighted, (full + DEFAULT_PREFIX_WEIGHT * sum(prefixes)) / (1 + 2 * DEFAULT_PREFIX_WEIGHT)
    )
    torch.testing.assert_close(plain_mean, torch.stack([full, *prefixes]).mean())  # the paper's equal weights
    assert weighted.item() != pytest.approx(full.item(), abs=1e-4)  # it adds terms
    assert MatryoshkaLoss(family, [4]).model_inputs == family.model_inputs  # everything else is the family's


def test_gradient_caching_gives_the_nested_losss_gradients():
    nested, model, inputs = MatryoshkaLoss(FAMILIES["clip-tiny"], [4]), _model("clip-tiny"), _inputs()
    nested.contrastive_loss(model, inputs, LossScope(global_negatives=True)).backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    gradient_cached_backward(nested, model, inputs, 4, scope=LossScope(global_negatives=True))  # type: ignore[arg-type]
    for name, grad in _grads(model).items():  # the floor: key biases, zero but for rounding (softmax cancels them)
        scale = max(1e-5, 1e-6 * plain[name].abs().max().item())
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=scale, msg=name)


def test_a_list_that_is_not_of_sizes_is_refused(tmp_path):
    from vlfit.training.arguments import VlfitTrainingArguments

    with pytest.raises(ConfigError, match=r"^--matryoshka_dims 64,x: 'x' is not a positive integer; give comma"):
        VlfitTrainingArguments(output_dir=str(tmp_path), matryoshka_dims="64,x")
    assert VlfitTrainingArguments(output_dir=str(tmp_path), matryoshka_dims="64, 16").matryoshka_sizes() == (16, 64)
    with pytest.raises(ConfigError, match=r"^--matryoshka_prefix_weight must be in \(0, 1\], got 0.0"):
        VlfitTrainingArguments(output_dir=str(tmp_path), matryoshka_dims="16", matryoshka_prefix_weight=0.0)


def test_a_prefix_weight_without_sizes_is_refused_in_one_line(tmp_path):
    from vlfit.arguments import DataArguments, ModelArguments
    from vlfit.arguments.flag_rules import check_flag_rules
    from vlfit.training.arguments import VlfitTrainingArguments

    training = VlfitTrainingArguments(output_dir=str(tmp_path), matryoshka_prefix_weight=0.5)
    with pytest.raises(ConfigError, match=r"^--matryoshka_prefix_weight weighs the losses of --matryoshka_dims"):
        check_flag_rules(ModelArguments(model_preset="clip-tiny"), DataArguments(dataset_name=str(tmp_path)), training,
                         task="retrieval")  # fmt: skip


@pytest.mark.slow
def test_a_run_records_its_sizes_for_every_door_and_refuses_sizes_its_model_cannot_hold(
    synthetic_dataset_dir, tmp_path, capsys
):
    import vlfit
    from vlfit.cli import main

    with single_torch_thread():
        assert main(["train", *tiny_train_argv(synthetic_dataset_dir, tmp_path / "run", "--matryoshka_dims", "8,16",
                                               "--save_strategy", "no", steps=2)]) == 0  # fmt: skip
        assert json.loads((tmp_path / "run" / "input_spec.json").read_text())["matryoshka_dims"] == [8, 16]
        assert vlfit.load(str(tmp_path / "run")).encoder.spec.matryoshka_dims == (8, 16)  # what every door reads
        capsys.readouterr()
        code = main(["train", *tiny_train_argv(synthetic_dataset_dir, tmp_path / "big", "--matryoshka_dims", "4096",
                                               steps=2)])  # fmt: skip
    assert code == 2
    assert "--matryoshka_dims 4096: 4096 is not below the model's embedding size" in capsys.readouterr().err
    assert not (tmp_path / "big" / "trainer_state.json").exists()
