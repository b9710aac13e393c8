"""FLOPs per training sample, counted on a real step, and what they make of samples/s: TFLOP/s and MFU.

``torch.utils.flop_counter.FlopCounterMode`` counts the matrix work (matmuls, convolutions, attention) of what
runs inside it, forward and backward, at the shapes the batch really has (its padded text length, its image size).
Elementwise work (normalization, activations, the optimizer) is not counted, as in every MFU figure: MFU is the
share of the device's peak matrix throughput that the model's matrix work achieves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from vlfit.efficiency.peaks import PeakFlops

T = TypeVar("T")


def _register_cpu_attention() -> None:
    """Count torch's CPU fused attention like its CUDA kernels (torch registers no formula for it, so on CPUs every
    ``scaled_dot_product_attention``, e.g. in ``nn.MultiheadAttention``, would count as zero)."""
    aten = torch.ops.aten
    pairs = (
        (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), flop_counter.sdpa_flop),
        (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None), flop_counter.sdpa_backward_flop),
    )
    for target, formula in pairs:
        if target is not None and target not in flop_counter.flop_registry:
            flop_counter.flop_registry[target] = formula


_register_cpu_attention()


def count_flops(step: Callable[[], T]) -> tuple[T, int]:
    """Run ``step`` (e.g. a forward and backward) and count its floating-point operations.

    The count is the same for a compiled model (the counter sees the operations the compiled graph runs); the
    counter's module hooks are global ones, about which ``torch.compile`` warns needlessly here.

    Returns:
        What ``step`` returned, and the FLOPs it took (a multiply-add counts 2).
    """
    with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        result = step()
    return result, int(counter.get_total_flops())


@dataclass(frozen=True)
class ComputeEfficiency:
    """Achieved matrix throughput against the peak.

    Attributes:
        flops_per_sample: FLOPs of one training sample (forward and backward).
        samples_per_second: Throughput of all processes together.
        peak: Peak matrix throughput of one device.
        processes: Devices training together (each with this peak).
    """

    flops_per_sample: float
    samples_per_second: float
    peak: PeakFlops
    processes: int = 1

    @property
    def achieved_tflops(self) -> float:
        """TFLOP/s of all processes together."""
        return self.flops_per_sample * self.samples_per_second / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: achieved over the peak of every device."""
        return self.achieved_tflops / (self.peak.tflops * self.processes)

    def metrics(self, prefix: str = "") -> dict[str, Any]:
        """``flops_per_sample``, ``tflops_per_second``, ``mfu`` and the peak's figure and source, prefixed."""
        figures = {
            "flops_per_sample": float(self.flops_per_sample),
            "tflops_per_second": self.achieved_tflops,
            "mfu": self.mfu,
            **self.peak.as_dict(),
        }
        return {f"{prefix}{key}": value for key, value in figures.items()}

    def describe(self) -> str:
        """One line for logs: GFLOPs per sample, TFLOP/s, MFU and where the peak comes from (and, above 100%, that
        the measured peak is not the device's: other work held its cores while it was timed)."""
        devices = f" x {self.processes} devices" if self.processes > 1 else ""
        line = (
            f"{self.flops_per_sample / 1e9:.2f} GFLOPs per sample (forward and backward), "
            f"{flops_rate(self.achieved_tflops)} = {100 * self.mfu:.1f}% MFU of {flops_rate(self.peak.tflops)} "
            f"{self.peak.precision}{devices} ({self.peak.device}; {self.peak.source})"
        )
        if self.mfu > 1:
            line += (
                "; above 100%: the peak was measured while other work held the cores, so this MFU means nothing "
                "(run on an idle machine, or compare samples/s)"
            )
        return line


def flops_rate(tflops: float) -> str:
    """``412.3 TFLOP/s``, or ``26.7 GFLOP/s`` below one TFLOP/s (CPUs)."""
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{1e3 * tflops:.1f} GFLOP/s"
