"""Where an export folder's graphs run: ONNX Runtime's CPU provider or OpenVINO's CPU plugin (``GraphRuntime``), on
a runtime's threads, and at the precision OpenVINO is asked for (``openvino_hint``: f32 when fp32 is asked, bf16 on a
CPU with bf16 matrix units). ``vlfit.inference.backends`` (the exported encoder) and ``vlfit.inference.pair_scorer``
open their graphs through ``graph_runtime``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from vlfit.efficiency.cpu import cpu_info
from vlfit.extras import require_extra
from vlfit.inference.exported import ExportFolder
from vlfit.inference.identity import RefusedModelError
from vlfit.inference.runtime_settings import RuntimeSettings


class GraphRuntime(ABC):
    """Where an export folder's graphs run: what is each runtime's own, opening a graph and calling it
    (``ExportedPart`` holds the rest, for the encoder and the pair scorer alike).

    Attributes:
        backend: ``onnxruntime`` or ``openvino``.
    """

    backend: ClassVar[str]

    @abstractmethod
    def open(self, path: str) -> Any:
        """The graph at ``path``, ready to call."""

    @abstractmethod
    def run(self, graph: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """``graph``'s one output for ``feeds``."""


@dataclass(frozen=True)
class OnnxRuntimeGraphs(GraphRuntime):
    """ONNX Runtime's CPU provider.

    Attributes:
        num_threads: Intra-op threads (``None``: ONNX Runtime's default, one per physical core).
        allow_spinning: Let idle intra-op threads spin-wait for the next call (ONNX Runtime's default: lowest
            latency for back-to-back calls). A server turns it off: spinning threads take the cores its event loop
            needs (on 2 cores at 8 concurrent queries: about 260 QPS with it, about 400 without).
    """

    num_threads: int | None = None
    allow_spinning: bool = True
    backend: ClassVar[str] = "onnxruntime"

    def __post_init__(self) -> None:
        require_extra("export", "the onnxruntime backend", ("onnxruntime",))  # before a folder is read

    def open(self, path: str) -> Any:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if self.num_threads:
            options.intra_op_num_threads = self.num_threads
        if not self.allow_spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def run(self, graph: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
        (out,) = graph.run(None, feeds)
        return out


@dataclass(frozen=True)
class OpenVinoGraphs(GraphRuntime):
    """OpenVINO's CPU plugin; every graph is compiled by one ``openvino.Core`` per process, as OpenVINO advises.

    Attributes:
        inference_precision: The plugin's ``INFERENCE_PRECISION_HINT``: ``f32``, or ``None`` for the plugin's
            default (bf16 on CPUs that have it).
        num_threads: ``INFERENCE_NUM_THREADS`` (``None``: the plugin's default).
    """

    inference_precision: str | None = None
    num_threads: int | None = None
    backend: ClassVar[str] = "openvino"

    def __post_init__(self) -> None:
        require_extra("export", "the openvino backend", ("openvino",))  # before a folder is read

    def open(self, path: str) -> Any:
        config: dict[str, Any] = {}
        if self.inference_precision:
            config["INFERENCE_PRECISION_HINT"] = self.inference_precision
        if self.num_threads:
            config["INFERENCE_NUM_THREADS"] = self.num_threads
        return _openvino_core().compile_model(path, "CPU", config)

    def run(self, graph: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(graph(feeds)[graph.output(0)])


@functools.cache
def _openvino_core() -> Any:
    import openvino as ov

    return ov.Core()


def graph_runtime(
    exported: ExportFolder, settings: RuntimeSettings, inference_precision: str | None = None
) -> GraphRuntime:
    """The runtime of ``exported``'s format on ``settings``' threads (ONNX Runtime: and spinning; OpenVINO: at
    ``inference_precision``)."""
    if exported.runtime == "openvino":
        return OpenVinoGraphs(inference_precision, settings.num_threads)
    return OnnxRuntimeGraphs(settings.num_threads, settings.allow_spinning)


def openvino_hint(exported: ExportFolder, settings: RuntimeSettings) -> str | None:
    """OpenVINO's ``INFERENCE_PRECISION_HINT`` for an encoder on ``settings``: ``f32`` for ``--precision fp32`` (what
    was asked, where the plugin's own default is bf16 on a CPU with AMX), ``bf16`` for ``--precision bf16``, else
    ``settings.inference_precision`` (``None``: the plugin's default, whose cosine to PyTorch the export's manifest
    records).

    Raises:
        RefusedModelError: ``bf16`` for an export that does not run on OpenVINO, or on a CPU without bf16 matrix
            units (``amx_bf16``, ``avx512_bf16``), where it would be emulated.
    """
    if settings.precision == "bf16":
        if exported.runtime != "openvino":
            raise RefusedModelError(
                f"{exported.path}: --precision bf16 runs an OpenVINO export's graphs in bf16; this export runs on "
                f"{exported.runtime}: export with --format openvino, or use --precision fp32 or int8"
            )
        cpu = cpu_info()
        if not (cpu.has_amx_bf16 or "avx512_bf16" in cpu.features):
            raise RefusedModelError(
                f"--precision bf16: this CPU ({cpu.describe()}) has neither amx_bf16 nor avx512_bf16, so OpenVINO "
                "would emulate bf16, slower than fp32; use --precision fp32 or int8"
            )
        return "bf16"
    if settings.precision == "fp32" and exported.runtime == "openvino":
        return "f32"
    return settings.inference_precision
