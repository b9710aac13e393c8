"""What ``VlfitTrainer`` does at every step beside the step itself stays cheap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from vlfit.data.batch import Batch
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.models.loading import load_model
from vlfit.training.trainer import VlfitTrainer


def test_floating_point_ops_counts_the_parameters_once(tmp_path: Path) -> None:
    # The Trainer adds each step's FLOPs to total_flos; counting the parameters walks every module and parameter.
    bundle = load_model(model_preset="tiny", captions=lambda: ["a cat", "a dog"] * 20)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), args.device)
    trainer = VlfitTrainer(model=bundle.model, args=args, pipeline=pipeline, family=bundle.family)
    inputs = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    expected = Trainer.floating_point_ops(trainer, inputs)
    assert expected > 0
    counts = []
    count_parameters = bundle.model.num_parameters
    bundle.model.num_parameters = lambda **kwargs: counts.append(kwargs) or count_parameters(**kwargs)
    assert [trainer.floating_point_ops(inputs) for _ in range(3)] == [expected] * 3
    assert counts == [{"exclude_embeddings": True}]
    assert trainer.floating_point_ops({"pixel_values": torch.zeros(1)}) == 0  # no main input: nothing counted


def test_gradient_clipping_lists_the_parameters_once_and_clips_as_accelerate_does(tmp_path: Path) -> None:
    # accelerate's clip_grad_norm_ walks every module for model.parameters() at every step.
    bundle = load_model(model_preset="tiny", captions=lambda: ["a cat", "a dog"] * 20)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_grad_norm=0.5)
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), args.device)
    trainer = VlfitTrainer(model=bundle.model, args=args, pipeline=pipeline, family=bundle.family)
    model = trainer.model
    parameters = model.parameters
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(p.shape, generator=generator) for p in parameters()]

    def set_gradients() -> None:
        for parameter, gradient in zip(parameters(), gradients, strict=True):
            parameter.grad = gradient.clone()

    set_gradients()
    expected_norm = Trainer._clip_grad_norm(trainer, model)  # accelerate's clipping
    expected = [p.grad.clone() for p in parameters()]
    assert expected_norm > args.max_grad_norm  # so the gradients were scaled down
    walks = []
    model.parameters = lambda *a, **k: walks.append(1) or parameters(*a, **k)
    for _ in range(3):
        set_gradients()
        assert trainer._clip_grad_norm(model) == expected_norm
        assert all(torch.equal(p.grad, e) for p, e in zip(parameters(), expected, strict=True))
    assert len(walks) == 1


def test_the_plain_step_is_the_trainers_and_sets_training_mode_only_where_it_is_not(tmp_path: Path) -> None:
    # model.train() walks every module; the Trainer's step calls it at every step.
    bundle = load_model(model_preset="tiny", captions=lambda: ["a cat", "a dog"] * 20)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, gradient_accumulation_steps=2)
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), args.device)
    trainer = VlfitTrainer(model=bundle.model, args=args, pipeline=pipeline, family=bundle.family)
    trainer.flops_per_sample = 1.0  # the first step's FLOP count is not what this holds
    trainer.current_gradient_accumulation_steps = 2  # the loss is scaled for accumulation, as the Trainer's is
    generator = torch.Generator().manual_seed(0)
    size = bundle.inputs.image_size
    inputs = {
        "input_ids": torch.randint(5, 60, (4, 8), generator=generator),
        "attention_mask": torch.ones(4, 8, dtype=torch.long),
        "pixel_values": torch.randn(4, 3, size, size, generator=generator),
    }
    batch = Batch(inputs=inputs, sample_ids=list("abcd"), positions=[0, 1, 2, 3], on_device=True)
    model = trainer.model
    assert trainer._step_is_plain

    def step(run) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        torch.manual_seed(0)  # the same dropout
        loss = run()
        return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model.train()
    expected_loss, expected_grads = step(lambda: Trainer.training_step(trainer, model, batch))
    modes = []
    train = model.train
    model.train = lambda mode=True: modes.append(mode) or train(mode)
    loss, grads = step(lambda: trainer.training_step(model, batch))
    assert torch.equal(loss, expected_loss) and len(grads) == len(expected_grads) > 0
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    assert modes == []  # in training mode already: not walked again
    model.eval()
    modes.clear()
    trainer.training_step(model, batch)
    assert modes == [True] and model.training and all(m.training for m in model.modules())
    trainer.args.optim = "lomo"
    assert not trainer._step_is_plain  # the Trainer's step, which hands LOMO its learning rate


def test_within_an_epoch_the_models_zero_grad_sets_its_listed_gradients_to_none_without_walking_it(
    tmp_path: Path, monkeypatch
) -> None:
    # The Trainer's loop calls model.zero_grad() after every optimizer step; nn.Module's walks every module for
    # parameters(). Its loop is transformers' code: a stand-in for it calls zero_grad as it does.
    bundle = load_model(model_preset="tiny", captions=lambda: ["a cat", "a dog"] * 20)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), args.device)
    trainer = VlfitTrainer(model=bundle.model, args=args, pipeline=pipeline, family=bundle.family)
    model = trainer.model
    parameters = list(model.parameters())
    seen = []
    walks = []
    real_walk = torch.nn.Module.parameters

    def counted_walk(*args, **kwargs):
        walks.append(1)
        return real_walk(*args, **kwargs)

    def epoch(self, model, *args, **kwargs):
        for _ in range(3):
            for parameter in parameters:
                parameter.grad = torch.ones_like(parameter)
            walks.clear()
            with monkeypatch.context() as patch:
                patch.setattr(torch.nn.Module, "parameters", counted_walk)
                model.zero_grad()
            seen.append((len(walks), all(p.grad is None for p in parameters)))
        for parameter in parameters:
            parameter.grad = torch.ones_like(parameter)
        model.zero_grad(set_to_none=False)  # in place, as nn.Module's
        seen.append(all(p.grad is not None and not p.grad.any() for p in parameters))
        raise RuntimeError("the epoch failed")

    monkeypatch.setattr(Trainer, "_run_epoch", epoch)
    with pytest.raises(RuntimeError, match="the epoch failed"):
        trainer._run_epoch(model, 0)
    assert seen == [(0, True)] * 3 + [True]
    assert "zero_grad" not in vars(model)  # the model's own again, after the epoch as after a failed one
    trainer.args.optim = "lomo"  # not the plain step: the model's zero_grad is left alone
    seen.clear()
    with pytest.raises(RuntimeError):
        trainer._run_epoch(model, 0)
    assert seen[0][0] == 1
