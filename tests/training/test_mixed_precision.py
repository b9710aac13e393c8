"""`vlfit train --bf16` on the CPU: the model computes under bf16 autocast, end to end through the CLI; with
`--bf16_weights` its weights are bf16 while it trains and fp32 where it is saved."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import vlfit.training.run as run_module
from tests.training.recording import RecordingTrainer
from vlfit.cli import main

pytestmark = pytest.mark.slow


def _train(monkeypatch: pytest.MonkeyPatch, dataset_dir: str, output_dir: str, *flags: str) -> RecordingTrainer:
    trainers: list[RecordingTrainer] = []

    class Kept(RecordingTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(run_module, "VlfitTrainer", Kept)
    assert main(["train", "--model_preset", "tiny", "--dataset_name", dataset_dir, "--output_dir", output_dir,
                 "--max_steps", "3", "--per_device_train_batch_size", "8", "--report_to", "none",
                 "--save_strategy", "no", "--dataloader_num_workers", "0", "--seed", "7", *flags]) == 0  # fmt: skip
    return trainers[0]


def test_bf16_on_cpu_autocasts_the_model_and_trains(tmp_path, monkeypatch, synthetic_dataset_dir):
    # Global negatives: the loss vlfit computes outside the model (the local one is covered under torchrun).
    common = ["--contrastive_negatives", "global"]
    fp32 = _train(monkeypatch, synthetic_dataset_dir, str(tmp_path / "fp32"), *common)
    assert fp32.accelerator.mixed_precision == "no"  # read now: accelerate's state is shared by later runs
    bf16 = _train(monkeypatch, synthetic_dataset_dir, str(tmp_path / "bf16"), "--bf16", *common)
    assert bf16.accelerator.mixed_precision == "bf16"

    assert fp32.matmul_dtypes == {"torch.float32"} and bf16.matmul_dtypes == {"torch.bfloat16"}
    assert bf16.args.use_cpu and bf16.args.device.type == "cpu"
    assert all(math.isfinite(loss) for loss in bf16.losses) and len(bf16.losses) == 3
    # Same weights, same first batch: bf16 rounding moves the loss a little, not a lot.
    assert bf16.losses[0] != fp32.losses[0]
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], abs=0.1)


def test_bf16_weights_train_within_a_hundredth_of_fp32_and_save_fp32(tmp_path, monkeypatch, synthetic_dataset_dir):
    fp32 = _train(monkeypatch, synthetic_dataset_dir, str(tmp_path / "fp32"))
    weights = _train(monkeypatch, synthetic_dataset_dir, str(tmp_path / "weights"), "--bf16", "--bf16_weights")
    assert weights.matmul_dtypes == {"torch.bfloat16"}
    # The loss curve: every step within 0.01 of fp32's (measured: within 0.003 over 6 steps of this preset).
    assert len(weights.losses) == len(fp32.losses) == 3
    for step, (bf16_loss, fp32_loss) in enumerate(zip(weights.losses, fp32.losses, strict=True)):
        assert bf16_loss == pytest.approx(fp32_loss, abs=0.01), step
    # What comes after training, and the saved model, have the fp32 weights the optimizer updated.
    assert {p.dtype for p in weights.model.parameters()} == {torch.float32}
    saved = load_file(Path(tmp_path / "weights" / "model.safetensors"))
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
    name, held = next((n, p) for n, p in weights.model.named_parameters() if p.requires_grad and p.dim() == 2)
    assert torch.equal(saved[name], held.detach())
    assert not torch.equal(held.detach(), held.detach().bfloat16().float())  # fp32 values, not bf16 ones widened
