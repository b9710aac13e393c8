"""Run folders for the merge tests: copies of a tiny checkpoint with other weights, tokenizer or config."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import BridgeTowerForContrastiveLearning


def weights_of(folder: Path | str) -> dict[str, torch.Tensor]:
    """A folder's weights, as plain transformers loads them."""
    return BridgeTowerForContrastiveLearning.from_pretrained(folder).state_dict()


def changed_run(
    checkpoint: Path, folder: Path, change: Callable[[str, torch.Tensor], torch.Tensor] | None = None
) -> Path:
    """A copy of ``checkpoint`` (tokenizer, image processor and all) whose floating-point weights are
    ``change(name, tensor)``; the same weights without ``change``."""
    shutil.copytree(checkpoint, folder)
    if change is not None:
        model = BridgeTowerForContrastiveLearning.from_pretrained(checkpoint)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if tensor.is_floating_point():
                    tensor.copy_(change(name, tensor))
        model.save_pretrained(folder)
    return folder


def record_base(folder: Path, base: str) -> Path:
    """Write the ``run_flags.json`` vlfit train leaves, saying the run was fine-tuned from ``base``."""
    (folder / "run_flags.json").write_text(json.dumps({"flags": {"model_name_or_path": base}, "given": []}))
    return folder
