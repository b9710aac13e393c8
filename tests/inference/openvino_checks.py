"""What the OpenVINO tests check, run in a process of their own: OpenVINO's runtime is never loaded in a test
process (left in one, its threads outlived the test and later crashed an unrelated test in the same process).

Run as ``python tests/inference/openvino_checks.py encoder CHECKPOINT ONNX_EXPORT OUT`` (export the checkpoint to
OpenVINO in OUT, its ONNX graphs copied from ONNX_EXPORT instead of traced again, and hold both precisions against
PyTorch) or ``... pair CHECKPOINT ONNX_EXPORT OUT`` (the same export of a checkpoint with a matching head, its ITM
graph copied too, and its pair scorer against PyTorch's); each prints one JSON object.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import torch

from vlfit.data.sources.synthetic import synthetic_source
from vlfit.errors import ConfigError
from vlfit.inference.backends import TorchEncoder
from vlfit.inference.export_samples import load_samples
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings

CAPTIONS = ["red", "two blue squares on the left and one green circle at the top of the picture, and more words"]


def min_cosine_against_torch(encoder, reference: TorchEncoder, pixels: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """The lowest cosine between ``encoder``'s embeddings and PyTorch's, over batches and caption lengths unlike the
    export example's (odd batch sizes; 3 and ~25 tokens where the example has 9; one caption alone)."""

    def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)

    found = [cosines(encoder.encode_images(pixels[rows]), reference.encode_images(pixels[rows])).min()
             for rows in (slice(0, 5), slice(5, 6))]  # fmt: skip
    tokens = reference.tokenize(CAPTIONS * 2 + CAPTIONS[:1])
    assert tokens["input_ids"].shape[1] != 9
    found.append(cosines(encoder.encode_tokens(**tokens), reference.encode_tokens(**tokens)).min())
    short = reference.tokenize(CAPTIONS[:1])
    found.append(cosines(encoder.encode_tokens(**short), reference.encode_tokens(**short)).min())
    return float(min(found))


def run_openvino_check(*args: str) -> dict:
    """This file run as a script with ``args`` in a process of its own; what it printed."""
    command = [sys.executable, __file__, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_copying_onnx_graphs(checkpoint: str, onnx_export: str, out: str, samples: int) -> dict:
    """``vlfit export --format openvino --quantize int8`` of ``checkpoint`` into ``out`` on ``samples`` synthetic
    parity samples, its ONNX graphs copied from ``onnx_export`` (the same weights) instead of traced again: tracing is
    the ONNX export's, tested in the test process. The manifest."""
    from vlfit.inference import export as export_module
    from vlfit.inference import export_itm
    from vlfit.inference.export import ExportSettings, export_model

    def copy_graphs(loaded, folder, opset):  # type: ignore[no-untyped-def]
        return {t: shutil.copy(f"{onnx_export}/{t}.onnx", f"{folder}/{t}.onnx") for t in ("image", "text")}

    export_module.export_onnx_towers = copy_graphs
    export_itm.export_onnx_itm = lambda graph, path, *shape: shutil.copy(f"{onnx_export}/itm.onnx", path)
    loaded = ModelRuntime.open(checkpoint).encoder
    parity = load_samples(synthetic_source(samples), loaded.spec)
    return export_model(loaded, out, ExportSettings("openvino", "int8"), parity_samples=parity)


def encoder_check(checkpoint: str, onnx_export: str, out: str) -> dict:
    manifest = export_copying_onnx_graphs(checkpoint, onnx_export, out, 9)
    reference = ModelRuntime.open(checkpoint).encoder
    pixels = load_samples(synthetic_source(6, seed=5), reference.spec).pixels
    fp32 = ModelRuntime.open(out, RuntimeSettings(precision="fp32")).encoder  # asked fp32: computed in f32
    try:
        bf16 = ModelRuntime.open(out, RuntimeSettings(precision="bf16")).encoder
        bf16_figures = {"bf16_hint": _hint(bf16), "bf16_min_cosine": min_cosine_against_torch(bf16, reference, pixels)}
    except ConfigError as error:  # a CPU without bf16 matrix units
        bf16_figures = {"bf16_refusal": str(error)}
    return {
        "fp32_hint": _hint(fp32),
        **bf16_figures,
        "default_precision": manifest["parity"]["openvino_default_precision"]["precision"],
        "fp32_backend": fp32.backend,
        "fp32_min_cosine": min_cosine_against_torch(fp32, reference, pixels),
        "int8_min_cosine": min_cosine_against_torch(
            ModelRuntime.open(out, RuntimeSettings(precision="int8")).encoder, reference, pixels
        ),
    }


def _hint(encoder) -> str:  # type: ignore[no-untyped-def]
    hint = encoder.graphs["image"].get_property("INFERENCE_PRECISION_HINT")
    return hint.to_string() if hasattr(hint, "to_string") else str(hint)


def pair_check(checkpoint: str, onnx_export: str, export: str) -> dict:
    from vlfit.inference.pair_scorer import ExportedPairScorer

    manifest = export_copying_onnx_graphs(checkpoint, onnx_export, export, 13)
    fp32 = ModelRuntime.open(export, RuntimeSettings(precision="fp32")).require_pair_scorer()
    pixels = load_samples(synthetic_source(5, seed=7), fp32.spec).pixels
    rows = (torch.arange(2).repeat_interleave(5), torch.arange(5).repeat(2))
    expected = ModelRuntime.open(checkpoint).require_pair_scorer().score_pairs(CAPTIONS, pixels, *rows)
    int8 = ModelRuntime.open(export).pair_scorer  # precision auto: the itm graph's INT8
    try:
        ModelRuntime.open(export, RuntimeSettings(backend="onnxruntime")).require_pair_scorer()
        refusal = ""
    except ConfigError as error:
        refusal = str(error)
    return {
        "manifest": manifest,
        "fp32": [isinstance(fp32, ExportedPairScorer), fp32.backend, fp32.precision],
        "fp32_max_diff": float((fp32.score_pairs(CAPTIONS, pixels, *rows) - expected).abs().max()),
        "int8": [isinstance(int8, ExportedPairScorer), int8.precision if int8 is not None else None],
        "int8_max_diff": float((int8.score_pairs(CAPTIONS, pixels, *rows) - expected).abs().max()),
        "refusal": refusal,
    }


CHECKS = {"encoder": encoder_check, "pair": pair_check}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]](*sys.argv[2:])))
