"""``--gradient_checkpointing`` for BridgeTower (which transformers refuses): every block of every tower is
checkpointed, a step keeps far fewer activations, and the loss and gradients equal the run without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from tests.training.train_runs import logged_losses, single_torch_thread, tiny_train_argv
from vlfit.cli import main
from vlfit.models.activation_checkpointing import _UNWRAPPED_FORWARD
from vlfit.models.bridgetower import BridgeTowerFamily, layer_stacks
from vlfit.models.registry import preset_config


def _tiny_model() -> BridgeTowerForContrastiveLearning:
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(preset_config("tiny"))
    model.train()  # dropout on: the recompute must draw the same masks
    BridgeTowerFamily().prepare_for_training(model)
    return model


def _step(model: BridgeTowerForContrastiveLearning) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and bytes of tensors saved for the backward of one step on a fixed batch."""
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "input_ids": torch.randint(5, 1000, (4, 12), generator=generator),
        "attention_mask": torch.ones(4, 12, dtype=torch.long),
        "pixel_values": torch.randn(4, 3, 64, 64, generator=generator),
    }
    saved_bytes = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved_bytes
        saved_bytes += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(2)  # dropout
    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = BridgeTowerFamily().contrastive_loss(model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, saved_bytes


@pytest.mark.slow
def is_checkpointed(layer) -> bool:
    """Whether ``checkpoint_layers`` wrapped ``layer`` (it keeps the layer's own forward aside)."""
    return _UNWRAPPED_FORWARD in vars(layer)


def test_checkpointing_keeps_loss_and_gradients_and_saves_fewer_activations():
    model = _tiny_model()
    loss, grads, saved = _step(model)
    model.gradient_checkpointing_enable()  # what the Trainer calls for --gradient_checkpointing
    stacks = layer_stacks(model)
    assert [len(stack) for stack in stacks] == [2, 2, 2, 2]
    assert all(is_checkpointed(layer) for stack in stacks for layer in stack)
    checkpointed_loss, checkpointed_grads, checkpointed_saved = _step(model)

    assert torch.equal(checkpointed_loss, loss)
    assert checkpointed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert checkpointed_saved < saved / 2

    model.gradient_checkpointing_disable()
    assert not any(is_checkpointed(layer) for stack in stacks for layer in stack)


def test_every_n_layers_counts_within_each_tower():
    model = _tiny_model()
    model.activation_checkpointing_enable(every_n_layers=2)
    assert [[is_checkpointed(layer) for layer in stack] for stack in layer_stacks(model)] == [[True, False]] * 4


@pytest.mark.slow
def test_gradient_checkpointing_flag_trains_the_same_steps(tmp_path: Path, synthetic_dataset_dir: str) -> None:
    def losses(out: Path, *extra: str) -> dict[int, float]:
        argv = tiny_train_argv(synthetic_dataset_dir, out, "--save_strategy", "no", *extra, steps=3)
        with single_torch_thread():
            assert main(["train", *argv]) == 0
        return logged_losses(out)

    plain = losses(tmp_path / "plain")
    checkpointed = losses(tmp_path / "checkpointed", "--gradient_checkpointing", "true")
    assert sorted(plain) == [1, 2, 3]
    assert checkpointed == pytest.approx(plain, rel=1e-5)
