"""Device peaks: data-sheet figures matched by device name, a measured peak elsewhere, and which precision a run's
matmuls use."""

from __future__ import annotations

import pytest
import torch

from vlfit.efficiency.peaks import PRECISIONS, device_table, known_peak, matmul_precision, measured_peak, peak_flops


@pytest.mark.parametrize(
    ("name", "precision", "device", "tflops"),
    [
        ("NVIDIA H200", "bf16", "NVIDIA H200 SXM", 989.4),
        ("NVIDIA H200 NVL", "bf16", "NVIDIA H200 NVL", 835.5),
        ("NVIDIA H100 80GB HBM3", "tf32", "NVIDIA H100 SXM", 494.7),
        ("NVIDIA H100 PCIe", "bf16", "NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", "NVIDIA A100", 19.5),
        ("NVIDIA L40S", "bf16", "NVIDIA L40S", 362.05),
        ("NVIDIA L4", "fp16", "NVIDIA L4", 121.0),
    ],
)
def test_known_accelerators_get_their_data_sheet_peak(name: str, precision: str, device: str, tflops: float) -> None:
    peak = known_peak(name, precision)
    assert peak is not None and peak.device == device and peak.tflops == tflops
    assert not peak.measured and "data sheet" in peak.source


def test_unknown_devices_and_missing_precisions_have_no_data_sheet_peak() -> None:
    assert known_peak("NVIDIA L40", "bf16") is None  # not the L4, not the L40S
    assert known_peak("Gaudi2", "fp32") is None  # the table has its bf16 figure only
    for entry in device_table():
        assert entry["source"] and set(entry["tflops"]) <= set(PRECISIONS)


def test_a_cpu_peak_is_measured_in_the_run() -> None:
    peak = peak_flops(torch.device("cpu"), "fp32")
    assert peak.measured and peak.tflops > 0 and "measured in this run" in peak.source
    small = measured_peak(torch.device("cpu"), "bf16", size=64, seconds=0.01)
    assert small.precision == "bf16" and small.tflops > 0
    assert peak_flops(torch.device("cpu"), "fp32") is peak  # measured once per process


def test_the_cpu_matrices_shrink_to_fit_the_time_budget() -> None:
    # A precision the CPU emulates (bf16: ~2 s per 1024-sided product) is timed on smaller matrices, not for 10 s.
    assert "256x256" in measured_peak(torch.device("cpu"), "fp32", seconds=1e-4).source
    assert "1024x1024" in measured_peak(torch.device("cpu"), "fp32", seconds=2.0).source


def test_matmul_precision_follows_autocast() -> None:
    cpu = torch.device("cpu")
    assert matmul_precision(cpu, "bf16") == "bf16" and matmul_precision(cpu, "fp32") == "fp32"
