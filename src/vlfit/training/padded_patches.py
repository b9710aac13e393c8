"""The share of a NaFlex run's image patches that are padding, per logging window and over the whole run.

A NaFlex batch is padded to its longest image (``vlfit.data.naflex.collate_patches``); the vision tower computes on
the padded patches too, so their share is compute spent on nothing. ``--train_sampling_strategy group_by_length``
lowers it (``vlfit.training.sampling``). The valid patches are summed on the batch's device and read only when a
figure is asked for (at logging steps), so counting never waits on the accelerator.
"""

from __future__ import annotations

import torch

from vlfit.data.batch import Batch

PATCH_MASK = "pixel_attention_mask"


class PaddedPatchMeter:
    """Counts the patches of NaFlex batches and how many of them are padding; silent for batches of square images."""

    def __init__(self) -> None:
        self._window = _Count()
        self._run = _Count()

    def add(self, batch: Batch) -> None:
        """Count ``batch``'s patches (nothing for a batch without a patch mask)."""
        mask = batch.inputs.get(PATCH_MASK)
        if mask is None:
            return
        valid = mask.sum()
        for count in (self._window, self._run):
            count.add(mask.numel(), valid)

    def window(self) -> dict[str, float]:
        """``padded_patch_share`` since the previous call; empty when no NaFlex batch came."""
        figures = self._window.figures()
        self._window = _Count()
        return figures

    def total(self) -> dict[str, float]:
        """``padded_patch_share`` over the whole run; empty when no NaFlex batch came."""
        return self._run.figures()


class _Count:
    def __init__(self) -> None:
        self.patches = 0
        self.valid: torch.Tensor | None = None

    def add(self, patches: int, valid: torch.Tensor) -> None:
        self.patches += patches
        self.valid = valid if self.valid is None else self.valid + valid.to(self.valid.device)

    def figures(self) -> dict[str, float]:
        if not self.patches or self.valid is None:
            return {}
        return {"padded_patch_share": 1.0 - float(self.valid.item()) / self.patches}
