"""INT8 graphs from fp32 ones: ONNX Runtime quantization for ONNX, NNCF post-training quantization for OpenVINO
(and ``convert_to_openvino``, the fp32 OpenVINO graph of an ONNX one).

- Text tower, ONNX: dynamic quantization (weights INT8 ahead of time, activation ranges computed per call), which
  needs no calibration data and suits inputs of varying length.
- Matching graph (the fused tower and ITM head, ``vlfit.inference.export_itm``), ONNX: dynamic quantization as the
  text tower's: its inputs vary in length and pair count, and it needs no calibration pairs.
- Image tower, ONNX: static quantization in QDQ form with activation ranges calibrated on real images, of the
  ``MatMul`` nodes only (every linear layer of the transformer): quantizing every op (the convolution of the patch
  embedding, additions, normalizations) cost far more accuracy in a trial (cosine 0.90 to fp32, against 0.9997).
- OpenVINO, image tower: ``nncf.quantize`` with the transformer model type (accuracy-sensitive operations kept
  in floating point, SmoothQuant), calibrated on the same images.
- OpenVINO, text tower and matching graph: ``nncf.compress_weights``, INT8 weights with floating-point
  activations, the OpenVINO counterpart of ONNX Runtime's dynamic quantization. Full post-training quantization
  did not work for the text tower: with the transformer model type, nncf 3.4 makes a text graph OpenVINO 2026.4's
  CPU plugin refuses to compile (constant folding fails on a Convert; with or without SmoothQuant, with Converts
  ignored), and without it the small preset's worst cosine to PyTorch fell to 0.924 (weight compression: 0.99989)
  in a trial.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

QUANTIZED_OP_TYPES = ("MatMul",)


def _quiet_onnxruntime_advice() -> None:
    # onnxruntime.quantization advises its pre-processing on the root logger for every graph. Its symbolic shape
    # inference fails on the exporter's graphs (onnxruntime 1.32), and without it the pre-processing left the INT8
    # image tower's cosine to PyTorch unchanged in a trial (0.99316 either way): the graphs are quantized as exported.
    logging.getLogger().addFilter(_drop_preprocessing_advice)


def _drop_preprocessing_advice(record: logging.LogRecord) -> bool:
    return "pre-processing before quantization" not in record.getMessage()


def quantize_onnx_dynamic(source: str, destination: str) -> None:
    """Dynamic INT8 quantization of a graph's ``MatMul`` nodes (signed INT8 weights, activation ranges per call)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    _quiet_onnxruntime_advice()
    quantize_dynamic(source, destination, op_types_to_quantize=list(QUANTIZED_OP_TYPES), weight_type=QuantType.QInt8)


def quantize_onnx_text(source: str, destination: str) -> None:
    """Dynamic INT8 quantization of the text tower's ``MatMul`` nodes."""
    quantize_onnx_dynamic(source, destination)


def quantize_onnx_image(source: str, destination: str, calibration: Sequence[dict[str, np.ndarray]]) -> None:
    """Static INT8 quantization (QDQ, MinMax calibration, per-tensor weights) of the image tower's ``MatMul`` nodes.

    Args:
        source: The fp32 graph.
        destination: Where to write the INT8 graph.
        calibration: Input dicts (``{"pixels": uint8 [b, 3, H, W]}``) to calibrate activation ranges on.
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    _quiet_onnxruntime_advice()

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    quantize_static(
        source,
        destination,
        Feeds(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(QUANTIZED_OP_TYPES),
        # Per-tensor weights: per-channel scales lowered the tiny preset's worst cosine to PyTorch from 0.9996 to
        # 0.993 in a trial (24 images; MinMax or Percentile calibration, INT8 or UINT8 activations alike).
        per_channel=False,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
    )


def quantize_openvino(source: str, destination: str, calibration: Sequence[dict[str, np.ndarray]]) -> None:
    """NNCF post-training INT8 quantization (``ModelType.TRANSFORMER``) of an OpenVINO graph.

    Args:
        source: The fp32 ``.xml``.
        destination: Where to write the INT8 ``.xml`` (and its ``.bin``).
        calibration: Input dicts to calibrate on.
    """
    import nncf
    import openvino as ov

    logging.getLogger("nncf").setLevel(logging.ERROR)  # its progress bars and subset-size notes
    quantized = nncf.quantize(
        ov.Core().read_model(source),
        nncf.Dataset(list(calibration)),
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=max(1, len(calibration)),  # every calibration batch
    )
    ov.save_model(quantized, destination, compress_to_fp16=False)


def compress_openvino_weights(source: str, destination: str) -> None:
    """INT8 weights (asymmetric, per output channel) of an OpenVINO graph; activations stay floating point."""
    import nncf
    import openvino as ov

    logging.getLogger("nncf").setLevel(logging.ERROR)
    compressed = nncf.compress_weights(ov.Core().read_model(source), mode=nncf.CompressWeightsMode.INT8_ASYM)
    ov.save_model(compressed, destination, compress_to_fp16=False)


def convert_to_openvino(onnx_path: str, xml_path: str) -> None:
    """An ONNX graph as OpenVINO IR, weights kept in fp32 (``compress_to_fp16`` would halve their precision)."""
    import openvino as ov

    ov.save_model(ov.convert_model(onnx_path), xml_path, compress_to_fp16=False)
