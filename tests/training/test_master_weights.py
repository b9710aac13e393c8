"""``--bf16_weights`` (``vlfit.training.master_weights``): bf16 weights in the step, fp32 copies in the optimizer."""

from __future__ import annotations

import copy

import torch
from torch import nn

from vlfit.training.master_weights import MasterWeights


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model[2].weight.requires_grad_(False)  # frozen: kept in fp32 for saving, never updated
    return model


def _loss(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs.to(next(model.parameters()).dtype)).float().pow(2).mean()


def test_gradients_accumulate_in_fp32_and_updates_too_small_for_bf16_land_in_the_copies() -> None:
    model = _model()
    start = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    weights = MasterWeights(model, optimizer)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for group in optimizer.param_groups for p in group["params"]} == {torch.float32}

    first, second = torch.randn(8, 16), torch.randn(8, 16)
    for inputs in (first, second):  # two micro-batches of one optimizer step
        _loss(model, inputs).backward()
    assert all(p.grad is None for p in model.parameters())  # taken into the copies as backward made them
    trained = [p for p in reference.parameters() if p.requires_grad]
    first_grads = torch.autograd.grad(_loss(reference, first), trained)
    second_grads = torch.autograd.grad(_loss(reference, second), trained)
    expected = [a.float() + b.float() for a, b in zip(first_grads, second_grads, strict=True)]
    for copy_, gradient in zip(weights.trained, expected, strict=True):
        assert copy_.grad is not None and copy_.grad.dtype == torch.float32
        assert torch.equal(copy_.grad, gradient)  # the fp32 sum, not a bf16 one

    for _ in range(3):
        optimizer.step()
        _loss(model, first).backward()
    first_weight = weights.trained[0]
    moved = (first_weight.detach() != start["0.weight"]).float().mean().item()
    rounded_moved = (model[0].weight.float() != start["0.weight"].bfloat16().float()).float().mean().item()
    assert moved > 0.9 and rounded_moved < 0.2  # lr 1e-6: lost to bf16's mantissa, kept in the copies
    assert torch.equal(model[0].weight, first_weight.detach().bfloat16())  # each step copied back


def test_the_fp32_view_saves_the_copies_and_release_leaves_the_model_fp32() -> None:
    model = _model()
    frozen = model[2].weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    weights = MasterWeights(model, optimizer)
    _loss(model, torch.randn(8, 16)).backward()
    optimizer.step()
    with weights.fp32():
        saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
    assert torch.equal(saved["0.weight"], weights.trained[0].detach())
    assert torch.equal(saved["2.weight"], frozen)  # not rounded to bf16 and back
    assert model[0].weight.dtype == torch.bfloat16  # bf16 again after the view

    weights.release()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
    _loss(model, torch.randn(8, 16)).backward()
    assert model[0].weight.grad is not None  # no hook takes the gradient any more
    # The optimizer is the model's again, with the copies' moments: a further step trains the model in fp32.
    assert [p for group in optimizer.param_groups for p in group["params"]] == [
        p for p in model.parameters() if p.requires_grad]  # fmt: skip
    assert optimizer.state[model[0].weight]["step"] == 1
    before = model[0].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model[0].weight.detach(), before)
    # Trained again (a second train() of one trainer): the copies take the weights and their state back.
    again = MasterWeights(model, optimizer)
    assert model[0].weight.dtype == torch.bfloat16 and optimizer.state[again.trained[0]]["step"] == 2
    _loss(model, torch.randn(8, 16)).backward()
    optimizer.step()
    assert optimizer.state[again.trained[0]]["step"] == 3
