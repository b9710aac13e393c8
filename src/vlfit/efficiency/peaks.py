"""The peak matrix throughput of the device a run trains on: from the vendors' data sheets for known accelerators
(``device_peaks.json``, each figure with its source), or measured with a short matmul in the same run for CPUs
and devices the table does not know.
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from vlfit.efficiency.cpu import cpu_info

PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak matrix throughput in one precision.

    Attributes:
        tflops: Dense peak, TFLOP/s per device.
        device: What it is for (``NVIDIA H200 SXM``, or the CPU's model name).
        precision: ``fp32``, ``tf32``, ``bf16`` or ``fp16``: the precision the run's matmuls use.
        source: Where the figure comes from (a data sheet, or the measurement that gave it).
        measured: True when measured in this run rather than taken from a data sheet.
    """

    tflops: float
    device: str
    precision: str
    source: str
    measured: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain data (for metrics and bench.json)."""
        return {
            "peak_tflops": self.tflops,
            "peak_device": self.device,
            "peak_precision": self.precision,
            "peak_source": self.source,
            "peak_measured": self.measured,
        }


@functools.cache
def device_table() -> list[dict[str, Any]]:
    """The data-sheet entries of ``device_peaks.json``, in match order."""
    text = resources.files("vlfit.efficiency").joinpath("device_peaks.json").read_text(encoding="utf-8")
    return json.loads(text)["devices"]


def matmul_precision(device: torch.device, autocast_precision: str) -> str:
    """The precision a run's matmuls use: the autocast dtype, or for float32 on CUDA, TF32 when torch allows it."""
    if autocast_precision in ("bf16", "fp16"):
        return autocast_precision
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def known_peak(device_name: str, precision: str) -> PeakFlops | None:
    """The data-sheet peak of a device named ``device_name`` (as ``torch.cuda.get_device_name`` gives it)."""
    for entry in device_table():
        if re.search(entry["pattern"], device_name, flags=re.IGNORECASE):
            tflops = entry["tflops"].get(precision)
            if tflops is None:
                return None
            return PeakFlops(float(tflops), entry["name"], precision, entry["source"])
    return None


def measured_peak(device: torch.device, precision: str, *, size: int | None = None, seconds: float = 0.3) -> PeakFlops:
    """Time square matmuls in ``precision`` on ``device`` with this process's threads: an achievable peak.

    Args:
        device: Where to measure.
        precision: ``fp32``, ``tf32``, ``bf16`` or ``fp16``.
        size: Matrix side. Default: the largest of 256, 512, 1024 (CPU; 8192 elsewhere) whose product takes at
            most a quarter of ``seconds``, so a precision the device only emulates (bf16 on most CPUs: about 1
            GFLOP/s, 2 s per 1024-sided product) is measured on smaller matrices within the budget.
        seconds: Roughly how long to time (after one warm-up product).
    """
    dtype = _DTYPES[precision]
    sized_to_budget = size is None and device.type == "cpu"
    a, b = _operands(device, dtype, 256 if sized_to_budget else size or 8192)
    torch.mm(a, b)  # warm-up
    if sized_to_budget:
        one = _time_products(device, a, b)
        while a.shape[0] < 1024 and one * 8 <= seconds / 4:  # doubling the side costs 8x per product
            a, b = _operands(device, dtype, a.shape[0] * 2)
            torch.mm(a, b)
            one = _time_products(device, a, b)
    size = a.shape[0]
    _synchronize(device)
    products, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        products += 1
        _synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and products >= 3:
            break
    tflops = 2 * size**3 * products / elapsed / 1e12
    name = cpu_info().model if device.type == "cpu" else _device_name(device)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    source = f"measured in this run: {products} {size}x{size} {precision} matmuls on {device.type}{threads}"
    return PeakFlops(tflops, name, precision, source, measured=True)


def _operands(device: torch.device, dtype: torch.dtype, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    return a, b


def _time_products(device: torch.device, a: torch.Tensor, b: torch.Tensor, tries: int = 3) -> float:
    """Seconds one ``a @ b`` takes: the shortest of ``tries`` (on a shared CPU a product that waited for a core
    would shrink the matrices, and a peak measured on small ones is far below the machine's)."""
    times = []
    for _ in range(tries):
        _synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def peak_flops(device: torch.device, precision: str) -> PeakFlops:
    """The data-sheet peak of a known accelerator, else one measured now (CPUs, unknown devices), once per process
    for each device, precision and thread count (a search's trials, or a bench's rows, share it)."""
    if device.type != "cpu":
        known = known_peak(_device_name(device), precision)
        if known is not None:
            return known
    return _measured_once(str(device), precision, torch.get_num_threads())


@functools.cache
def _measured_once(device: str, precision: str, threads: int) -> PeakFlops:
    return measured_peak(torch.device(device), precision)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
