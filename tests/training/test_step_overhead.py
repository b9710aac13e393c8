"""What ``VlfitTrainer`` does at every step beside the step itself stays cheap."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

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
