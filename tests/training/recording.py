"""A VlfitTrainer that records what each process trained on, and a ``vlfit`` entry point that uses it.

Run as a script (``torchrun ... tests/training/recording.py train ...``) it is ``python -m vlfit`` with the
recording trainer; each process writes ``rank<N>.json`` into ``$VLFIT_RECORD_DIR`` after training.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch

import vlfit.training.run as run_module
from vlfit.cli import main
from vlfit.data.batch import Batch
from vlfit.training.trainer import VlfitTrainer


def weights_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict's names and float32 values (a sharded tensor's full value: every process of an
    FSDP run must call it, in the same order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state_dict.items()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode() + full.detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()


class RecordingTrainer(VlfitTrainer):
    """Records sample ids per step, the dtype the model computes in, and (after training) a weights digest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[dict[str, Any]] = []
        self.matmul_dtypes: set[str] = set()
        self.losses: list[float] = []
        self._hooked = False

    def compute_loss(self, model: torch.nn.Module, inputs: Batch, *args: Any, **kwargs: Any) -> Any:
        if not self._hooked:
            layer = self.accelerator.unwrap_model(model).itc_text_head.fc
            layer.register_forward_hook(lambda module, args, out: self.matmul_dtypes.add(str(out.dtype)))
            self._hooked = True
        self.batches.append({"epoch": int(self.state.epoch or 0), "ids": list(inputs.sample_ids)})
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
        return loss

    def record(self) -> dict[str, Any]:
        """What this process saw and holds."""
        return {
            "rank": self.args.process_index,
            "world_size": self.args.world_size,
            "should_save": self.args.should_save,
            "batches": self.batches,
            "losses": self.losses,
            "matmul_dtypes": sorted(self.matmul_dtypes),
            "weights_sha256": weights_digest(self.accelerator.unwrap_model(self.model).state_dict()),
            # FSDP2 keeps each process's shard of a parameter as a DTensor; DDP keeps whole tensors.
            "sharded_parameters": sum(hasattr(p, "full_tensor") for p in self.model.parameters()),
            "vocab_sha256": hashlib.sha256(self.processing_class.backend_tokenizer.to_str().encode()).hexdigest(),
        }

    def train(self, *args: Any, **kwargs: Any) -> Any:
        result = super().train(*args, **kwargs)
        record_dir = os.environ.get("VLFIT_RECORD_DIR")
        if record_dir:
            with open(os.path.join(record_dir, f"rank{self.args.process_index}.json"), "w") as f:
                json.dump(self.record(), f)
        return result


if __name__ == "__main__":
    run_module.VlfitTrainer = RecordingTrainer
    sys.exit(main(sys.argv[1:]))
