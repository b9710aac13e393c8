"""vlfit trains with the Trainer's default optimizer, fused AdamW (``adamw_torch_fused``), on CUDA and CPUs alike."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Trainer

from vlfit.training.arguments import VlfitTrainingArguments


def test_default_optimizer_is_fused_adamw(tmp_path: Path) -> None:
    args = VlfitTrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert args.optim == "adamw_torch_fused"
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert optimizer_cls is torch.optim.AdamW and kwargs["fused"] is True
    # And fused AdamW runs on this device (the CPU here): one step changes the weights.
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = optimizer_cls([weight], **{**kwargs, "lr": 0.1})
    weight.sum().backward()
    optimizer.step()
    assert torch.all(weight < 1)
