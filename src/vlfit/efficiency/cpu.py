"""What CPU this is: its model name and the matrix features that decide which precision is fast on it.

A CPU with AMX (``amx_bf16``, ``amx_int8``: Xeon from Sapphire Rapids on) multiplies bf16 and int8 matrices in its
tile units, several times its fp32 rate; one with AVX-512 or AVX VNNI has int8 dot products but emulates bf16 (on
AVX2 alone a bf16 step ran 5.8x slower than fp32). Training logs, ``vlfit bench``, ``vlfit serve``'s ``/meta`` and
the benchmark records name it with ``cpu_info``, so a figure always comes with the CPU it was measured on.

The features are the kernel's (``/proc/cpuinfo``'s flags, Linux); torch's own reading is its CPU capability
(``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``, ``DEFAULT``...), the kernels it dispatches to.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache

CPUINFO = "/proc/cpuinfo"
# The features that decide a precision's speed, in the order they are named: AMX tiles (bf16, int8), int8 dot products
# (VNNI), bf16 vector instructions, and the vector width.
MATRIX_FEATURES = ("amx_bf16", "amx_int8", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512f", "avx2")


@dataclass(frozen=True)
class CpuInfo:
    """A CPU's model name, torch's CPU capability and the matrix features it has (of ``MATRIX_FEATURES``)."""

    model: str
    capability: str
    features: tuple[str, ...]

    @property
    def has_amx_bf16(self) -> bool:
        return "amx_bf16" in self.features

    @property
    def has_amx_int8(self) -> bool:
        return "amx_int8" in self.features

    @property
    def has_vnni(self) -> bool:
        return "avx512_vnni" in self.features or "avx_vnni" in self.features

    def describe(self) -> str:
        """One line: ``Intel(R) Xeon(R) Platinum 8480+ (torch AVX512; amx_bf16, amx_int8, avx512_vnni, ...)``."""
        features = ", ".join(self.features) or "none of " + ", ".join(MATRIX_FEATURES[:4])
        return f"{self.model} (torch {self.capability}; {features})"

    def record(self) -> dict[str, object]:
        """What a result's record says of the CPU."""
        return {"cpu": self.model, "cpu_capability": self.capability, "cpu_features": list(self.features)}


@cache
def cpu_info() -> CpuInfo:
    """This machine's CPU (read once per process)."""
    model, flags = _read_cpuinfo()
    return CpuInfo(
        model=model or platform.processor() or platform.machine(),
        capability=_torch_capability(),
        features=tuple(feature for feature in MATRIX_FEATURES if feature in flags),
    )


def _read_cpuinfo(path: str = CPUINFO) -> tuple[str, set[str]]:
    """The first processor's model name and flags in ``path`` (``""`` and none where it cannot be read)."""
    model, flags = "", set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def _torch_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError, RuntimeError):
        return "unknown"
