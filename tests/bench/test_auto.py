"""``vlfit train --dataloader_num_workers auto``: the flag rewrite and the probe on the run's own data and model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlfit.bench.auto import take_auto_workers
from vlfit.bench.plan import default_workers
from vlfit.cli import main


def test_take_auto_workers_rewrites_only_the_auto_value() -> None:
    assert take_auto_workers(["--x", "1", "--dataloader_num_workers", "auto"]) == (
        ["--x", "1", "--dataloader_num_workers", "0"],
        True,
    )
    assert take_auto_workers(["--dataloader_num_workers=auto"]) == (["--dataloader_num_workers=0"], True)
    assert take_auto_workers(["--dataloader_num_workers", "3"]) == (["--dataloader_num_workers", "3"], False)
    assert take_auto_workers(["--output_dir", "auto"]) == (["--output_dir", "auto"], False)
    assert take_auto_workers(None) == (None, False)


@pytest.mark.slow
def test_train_with_auto_workers_probes_and_uses_the_choice(tmp_path: Path, synthetic_dataset_dir: str, caplog) -> None:
    out = tmp_path / "model"
    caplog.set_level("INFO", logger="vlfit")
    argv = ["train", "--model_preset", "tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir", str(out),
            "--max_steps", "2", "--per_device_train_batch_size", "4", "--dataloader_num_workers", "auto",
            "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    assert main(argv) == 0
    chosen = [r.getMessage() for r in caplog.records if "--dataloader_num_workers auto ->" in r.getMessage()]
    assert len(chosen) == 1
    workers = int(chosen[0].split("->")[1].split()[0])
    assert workers in default_workers()
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.dataloader_num_workers == workers
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
