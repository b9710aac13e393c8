"""``vlfit export``'s work: the two towers of a checkpoint as ONNX or OpenVINO graphs, checked against PyTorch.

Steps, in a staging folder that replaces nothing until every check passed:

1. trace each tower (``vlfit.inference.towers``) with ``torch.onnx.export``'s dynamo exporter, batch and sequence
   axes dynamic; for OpenVINO, convert the ONNX graphs with ``openvino.convert_model``;
2. measure fp32 parity against PyTorch on real samples, in batches whose sizes and caption lengths differ from the
   export example's, and refuse (``ExportParityError``) when any embedding's cosine is below the threshold;
3. with ``--quantize int8``, write INT8 graphs (``vlfit.inference.quantize``) and measure their cosine to PyTorch
   and the change of text->image recall on the same samples;
4. when the model has an image-text matching head (BridgeTower trained with ``--objective contrastive+itm``) and
   the format is ONNX, trace the fused tower and head as ``itm.onnx`` (and ``itm.int8.onnx``), checked on the same
   samples (``vlfit.inference.export_itm``);
5. save the tokenizer and a manifest (``vlfit.inference.exported``) beside the graphs.

Recall is evaluation's (``vlfit eval``): over the unique images of the samples (several captions of one image, or
repeated bytes, are one image, ``vlfit.data.image_groups``), a caption finding any row of its image counts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vlfit.atomic_files import write_text_atomically
from vlfit.data.image_groups import group_images
from vlfit.errors import ConfigError
from vlfit.inference.backends import Encoder, ExportedEncoder, TorchEncoder
from vlfit.inference.export_samples import Samples
from vlfit.inference.exported import FORMATS, MANIFEST_NAME, TOWERS, ExportFolder, check_parity, graph_name
from vlfit.inference.graph_runtimes import OnnxRuntimeGraphs, OpenVinoGraphs
from vlfit.inference.identity import library_versions
from vlfit.inference.quantize import (
    compress_openvino_weights,
    convert_to_openvino,
    quantize_onnx_image,
    quantize_onnx_text,
    quantize_openvino,
)
from vlfit.inference.recall import pooled_recall_at_k
from vlfit.inference.staging import fp32_bytes, staged_export
from vlfit.inference.towers import EMBEDDING_OUTPUT, IMAGE_INPUT, PATCH_INPUTS, TEXT_INPUTS
from vlfit.models.input_spec_file import input_settings

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 18
PARITY_THRESHOLD = 0.9999
ITM_PARITY_TOLERANCE = 1e-3  # largest fp32 matching log-odds difference (vlfit.inference.export_itm)
# Parity batches: one single sample, then odd sizes; the export example has 2 rows of 9 tokens.
PARITY_BATCH_SIZES = (1, 7)
EXAMPLE_BATCH, EXAMPLE_TOKENS = 2, 9
CALIBRATION_BATCH_SIZE = 8
RECALL_KS = (1, 5)


@dataclass(frozen=True)
class ExportSettings:
    """Attributes:
    format: ``onnx`` or ``openvino``.
    quantize: ``None`` or ``int8``.
    opset: ONNX opset of the graphs.
    parity_threshold: Smallest fp32 cosine to PyTorch accepted, per embedding.
    itm_tolerance: Largest fp32 difference of matching log-odds to PyTorch accepted (the itm graph's).
    """

    format: str = "onnx"
    quantize: str | None = None
    opset: int = DEFAULT_OPSET
    parity_threshold: float = PARITY_THRESHOLD
    itm_tolerance: float = ITM_PARITY_TOLERANCE

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"unknown --format {self.format!r}; choose one of: {', '.join(FORMATS)}")
        if self.quantize not in (None, "int8"):
            raise ConfigError(f"unknown --quantize {self.quantize!r}; the one choice is int8")
        if not self.itm_tolerance > 0:
            raise ConfigError(
                f"--itm_tolerance must be above 0 (a largest log-odds difference), got {self.itm_tolerance}"
            )


# ----------------------------------------------------------------------------------------------- tracing


def export_onnx_towers(loaded: TorchEncoder, folder: str, opset: int = DEFAULT_OPSET) -> dict[str, str]:
    """Trace both towers into ``folder/image.onnx`` and ``folder/text.onnx``; returns tower -> path."""
    spec = loaded.spec
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence", max=spec.max_seq_length)
    pixels = torch.randint(0, 256, (EXAMPLE_BATCH, 3, spec.image_size, spec.image_size), dtype=torch.uint8)
    image_inputs, image_names, image_axes = (pixels,), [IMAGE_INPUT], ({0: batch},)
    if spec.max_num_patches is not None:  # NaFlex: patches, their mask and grids; the patch count a dynamic axis
        image_inputs, image_names, image_axes = _patch_example(spec, batch)
    input_ids = torch.randint(0, len(spec.tokenizer), (EXAMPLE_BATCH, EXAMPLE_TOKENS))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, EXAMPLE_TOKENS // 2 :] = 0
    paths = {tower: os.path.join(folder, graph_name(tower, "fp32", "onnx")) for tower in TOWERS}
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        # torch.onnx names the graph's axes after the Dims and warns, once per input, that it named an axis it
        # shares with another input only once.
        warnings.filterwarnings("ignore", message="# The axis name: .* will not be used", category=UserWarning)
        with loaded.loaded.family.export_context():
            program = torch.onnx.export(
                loaded.image_tower,
                image_inputs,
                input_names=image_names,
                output_names=[EMBEDDING_OUTPUT],
                dynamic_shapes=image_axes,
                opset_version=opset,
                dynamo=True,
                verbose=False,
            )
        program.save(paths["image"])
        program = torch.onnx.export(
            loaded.text_tower,
            (input_ids, attention_mask),
            input_names=list(TEXT_INPUTS),
            output_names=[EMBEDDING_OUTPUT],
            dynamic_shapes=({0: batch, 1: sequence}, {0: batch, 1: sequence}),
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
        program.save(paths["text"])
    return paths


def _patch_example(spec: Any, batch: Any) -> tuple[tuple[torch.Tensor, ...], list[str], tuple[dict, ...]]:
    """A NaFlex image graph's example inputs (two images, the second with half its rows padding), their names and
    dynamic axes (the batch, and the patch count up to the budget)."""
    budget, width = int(spec.max_num_patches), int(spec.patch_size) ** 2 * 3
    patches = torch.export.Dim("patches", max=max(budget, 2))
    side = max(1, math.isqrt(budget))
    count = side * (budget // side)
    pixels = torch.randint(0, 256, (EXAMPLE_BATCH, count, width), dtype=torch.uint8)
    mask = torch.ones(EXAMPLE_BATCH, count, dtype=torch.long)
    mask[1, count // 2 :] = 0
    shapes = torch.tensor([[side, budget // side]] * EXAMPLE_BATCH)
    shapes[1] = torch.tensor([1, count // 2])
    axes = ({0: batch, 1: patches}, {0: batch, 1: patches}, {0: batch})
    return (pixels, mask, shapes), [IMAGE_INPUT, *PATCH_INPUTS], axes


# ---------------------------------------------------------------------------------------------- measuring


def _batches(n: int) -> Iterator[slice]:
    """Slices of ``range(n)``: the sizes of ``PARITY_BATCH_SIZES``, the last repeated."""
    start, i = 0, 0
    while start < n:
        size = PARITY_BATCH_SIZES[min(i, len(PARITY_BATCH_SIZES) - 1)]
        yield slice(start, min(start + size, n))
        start, i = start + size, i + 1


def embed_samples(
    samples: Samples,
    encode_images: Callable[..., torch.Tensor],
    encode_tokens: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and caption embeddings of every sample, in parity batches (captions padded to each batch's longest)."""
    images, texts = [], []
    for rows in _batches(len(samples)):
        images.append(encode_images(*samples.images(rows)).float())
        tokens = tokenize(samples.captions[rows])
        texts.append(encode_tokens(tokens["input_ids"], tokens["attention_mask"]).float())
    return torch.cat(images), torch.cat(texts)


def cosine_figures(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Smallest and mean cosine between paired rows."""
    cosine = torch.nn.functional.cosine_similarity(reference.detach().double(), other.detach().double(), dim=1)
    return {"min_cosine": round(float(cosine.min()), 7), "mean_cosine": round(float(cosine.mean()), 7)}


def t2i_recall(text: torch.Tensor, image: torch.Tensor, image_keys: torch.Tensor | None = None) -> dict[str, float]:
    """Text->image recall@1/5 of paired embeddings, as ``vlfit eval`` scores them: over the unique images
    (``image_keys``: which image each row shows; ``None``: each row its own), each caption against them all."""
    first_rows, image_of_text = group_images(image_keys, text.shape[0])
    metrics = pooled_recall_at_k(text, image[first_rows], None, RECALL_KS, image_of_text=image_of_text)
    return {f"t2i_recall@{k}": round(metrics[f"t2i_recall@{k}"], 4) for k in RECALL_KS}


def _embed(encoder: Encoder, samples: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    return embed_samples(samples, encoder.encode_images, encoder.encode_tokens, encoder.tokenize)


def _open_staged(folder: str, manifest: dict[str, Any], precision: str, **options: Any) -> ExportedEncoder:
    runtime = OnnxRuntimeGraphs() if manifest["format"] == "onnx" else OpenVinoGraphs(**options)
    return ExportedEncoder(ExportFolder(folder, manifest), runtime, precision)


# ------------------------------------------------------------------------------------------------ the export


def _draft_manifest(loaded: TorchEncoder, settings: ExportSettings, checkpoint: str) -> dict[str, Any]:
    spec, identity = loaded.spec, loaded.identity
    size = spec.image_size
    image_inputs = [{"name": IMAGE_INPUT, "dtype": "uint8", "shape": ["batch", 3, size, size]}]
    image = {"size": size, "mean": list(spec.image_mean), "std": list(spec.image_std), "layout": "NCHW"}
    if spec.max_num_patches is not None:  # NaFlex: patches of each image's own grid, padded to the batch's longest
        width = int(spec.patch_size) ** 2 * 3  # type: ignore[arg-type]
        image_inputs = [{"name": IMAGE_INPUT, "dtype": "uint8", "shape": ["batch", "patches", width]},
                        {"name": PATCH_INPUTS[0], "dtype": "int64", "shape": ["batch", "patches"]},
                        {"name": PATCH_INPUTS[1], "dtype": "int64", "shape": ["batch", 2]}]  # fmt: skip
        image.update(layout="patches", max_num_patches=spec.max_num_patches, patch_size=spec.patch_size)
    return {
        "format_version": 1,
        "format": settings.format,
        "identity": identity.to_dict(),
        "graphs": {tower: {"fp32": graph_name(tower, "fp32", settings.format)} for tower in TOWERS},
        "inputs": {
            "image": image_inputs,
            "text": [{"name": name, "dtype": "int64", "shape": ["batch", "sequence"]} for name in TEXT_INPUTS],
        },
        "output": {"name": EMBEDDING_OUTPUT, "dtype": "float32", "shape": ["batch", identity.embedding_size]},
        "image": image,
        "text": {"max_seq_length": spec.max_seq_length},
        "input_spec": input_settings(spec),  # the run's input_spec.json, as the graphs take their inputs
        "opset": settings.opset,
        "libraries": library_versions(),
        "source": {"path": os.path.abspath(checkpoint), "sha256": identity.checkpoint_sha256},
    }


def check_output_dir(checkpoint: str, output_dir: str) -> None:
    """Refuse to export into the checkpoint's own folder (its manifest would make the checkpoint look exported)."""
    if os.path.abspath(output_dir) == os.path.abspath(checkpoint):
        raise ConfigError(f"--output_dir {output_dir} is the checkpoint folder itself; export into a folder of its own")


def export_model(
    loaded: TorchEncoder,
    output_dir: str,
    settings: ExportSettings,
    *,
    parity_samples: Samples,
    calibration_samples: Samples | None = None,
) -> dict[str, Any]:
    """Export ``loaded``'s towers into ``output_dir`` (created; graphs of an earlier export there are replaced).

    Args:
        loaded: The checkpoint on PyTorch (``ModelRuntime.open(...).encoder``).
        output_dir: Where the graphs, tokenizer and manifest go.
        settings: Format, quantization, opset and parity threshold.
        parity_samples: Real samples the parity and accuracy figures are measured on.
        calibration_samples: Images and captions INT8 calibrates on (``parity_samples`` when None).

    Returns:
        The manifest written.

    Raises:
        ExportParityError: when an fp32 graph's cosine to PyTorch is below the threshold; nothing is written.
        WriteFailedError: when a write fails while the export is staged (``DiskFullError``: the disk filled);
            nothing in ``output_dir`` is replaced.
    """
    check_output_dir(loaded.model_path, output_dir)
    exported_at = time.time()
    manifest = _draft_manifest(loaded, settings, loaded.model_path)
    manifest["source"]["exported_at"] = exported_at
    graphs = fp32_bytes(loaded.model) * (2 if settings.format == "openvino" else 1)  # OpenVINO stages ONNX too
    expected = graphs + (graphs // 4 if settings.quantize else 0)
    with staged_export(output_dir, MANIFEST_NAME, expected_bytes=expected) as staging:
        started = time.perf_counter()
        onnx_dir = os.path.join(staging, "onnx") if settings.format == "openvino" else staging
        os.makedirs(onnx_dir, exist_ok=True)
        onnx_paths = export_onnx_towers(loaded, onnx_dir, settings.opset)
        if settings.format == "openvino":
            for tower in TOWERS:
                convert_to_openvino(onnx_paths[tower], os.path.join(staging, graph_name(tower, "fp32", "openvino")))
        loaded.spec.tokenizer.save_pretrained(staging)
        manifest["export_seconds"] = round(time.perf_counter() - started, 1)

        reference_images, reference_texts = embed_samples(
            parity_samples,
            loaded.image_tower,
            loaded.text_tower,
            loaded.tokenize,
        )
        parity: dict[str, Any] = {"samples": len(parity_samples), "threshold": settings.parity_threshold}
        keys = parity_samples.image_keys
        accuracy: dict[str, Any] = {"torch_fp32": t2i_recall(reference_texts, reference_images, keys)}
        options = {"inference_precision": "f32"} if settings.format == "openvino" else {}
        images, texts = _embed(_open_staged(staging, manifest, "fp32", **options), parity_samples)
        parity["fp32"] = {
            "image": cosine_figures(reference_images, images),
            "text": cosine_figures(reference_texts, texts),
        }
        accuracy["fp32"] = t2i_recall(texts, images, keys)
        threshold = settings.parity_threshold
        check_parity(parity["fp32"], threshold, len(parity_samples), "the exported fp32 {tower} graph's")
        if settings.format == "openvino":
            parity["openvino_default_precision"] = _openvino_default_precision(
                staging, manifest, parity_samples, reference_images, reference_texts
            )

        if settings.quantize == "int8":
            calibration = calibration_samples if calibration_samples is not None else parity_samples
            _quantize(staging, onnx_paths, manifest, settings.format, calibration)
            images8, texts8 = _embed(_open_staged(staging, manifest, "int8"), parity_samples)
            parity["int8"] = {
                "image": cosine_figures(reference_images, images8),
                "text": cosine_figures(reference_texts, texts8),
                "calibration_samples": len(calibration),
            }
            accuracy["int8"] = t2i_recall(texts8, images8, keys)
            accuracy["int8_change"] = {
                key: round(accuracy["int8"][key] - accuracy["fp32"][key], 4) for key in accuracy["fp32"]
            }
        manifest["parity"], manifest["accuracy"] = parity, accuracy
        _export_matching_graph(loaded, staging, manifest, settings, parity_samples)

        if settings.format == "openvino":
            shutil.rmtree(onnx_dir)
        write_text_atomically(os.path.join(staging, MANIFEST_NAME), json.dumps(manifest, indent=1) + "\n")
    return manifest


def _export_matching_graph(
    loaded: TorchEncoder, staging: str, manifest: dict[str, Any], settings: ExportSettings, samples: Samples
) -> None:
    """The fused tower and ITM head as ``itm.onnx`` (``itm.xml`` for OpenVINO) when the model has a matching head
    (``vlfit.inference.export_itm``), with the run's re-ranking weight (``rerank.json``) when it saved one."""
    from vlfit.models.itm import has_itm_head

    if not has_itm_head(loaded.model):
        return
    from vlfit.inference.export_itm import export_itm_graph  # only here: it imports transformers' models
    from vlfit.inference.rerank_score import RERANK_FILE

    saved = os.path.join(loaded.model_path, RERANK_FILE)
    if os.path.isfile(saved):  # the run's re-ranking weight goes with its matching graph
        shutil.copyfile(saved, os.path.join(staging, RERANK_FILE))

    export_itm_graph(
        loaded,
        staging,
        manifest,
        opset=settings.opset,
        quantize=settings.quantize == "int8",
        samples=samples,
        tolerance=settings.itm_tolerance,
        fmt=settings.format,
        onnx_dir=os.path.join(staging, "onnx") if settings.format == "openvino" else None,
    )


def _openvino_default_precision(
    staging: str, manifest: dict[str, Any], samples: Samples, images: torch.Tensor, texts: torch.Tensor
) -> dict[str, Any]:
    """The CPU plugin's own inference precision (bf16 where the CPU has it) and its cosine to PyTorch."""
    encoder = _open_staged(staging, manifest, "fp32")
    hint = encoder.graphs["image"].get_property("INFERENCE_PRECISION_HINT")
    precision = hint.to_string() if hasattr(hint, "to_string") else str(hint)  # an openvino.Type: "f32", "bf16"
    figures: dict[str, Any] = {"precision": precision}
    if "f32" not in precision:
        default_images, default_texts = _embed(encoder, samples)
        figures["image"] = cosine_figures(images, default_images)
        figures["text"] = cosine_figures(texts, default_texts)
    return figures


def _calibration_feeds(samples: Samples) -> list[dict]:
    """The images INT8 calibrates on, in batches (the text towers' INT8 schemes need no calibration)."""
    names = [IMAGE_INPUT, *PATCH_INPUTS]
    feeds = []
    for start in range(0, len(samples), CALIBRATION_BATCH_SIZE):
        inputs = samples.images(slice(start, start + CALIBRATION_BATCH_SIZE))
        feeds.append({name: (value if value.dtype == torch.uint8 else value.long()).numpy()
                      for name, value in zip(names, inputs, strict=False)})  # fmt: skip
    return feeds


def _quantize(
    staging: str,
    onnx_paths: dict[str, str],
    manifest: dict[str, Any],
    fmt: str,
    calibration: Samples,
) -> None:
    image_feeds = _calibration_feeds(calibration)
    names = {tower: graph_name(tower, "int8", fmt) for tower in TOWERS}
    if fmt == "onnx":
        quantize_onnx_text(onnx_paths["text"], os.path.join(staging, names["text"]))
        quantize_onnx_image(onnx_paths["image"], os.path.join(staging, names["image"]), image_feeds)
        methods = {"image": "onnxruntime static (QDQ, MatMul)", "text": "onnxruntime dynamic (MatMul)"}
    else:
        fp32 = {tower: os.path.join(staging, graph_name(tower, "fp32", fmt)) for tower in TOWERS}
        quantize_openvino(fp32["image"], os.path.join(staging, names["image"]), image_feeds)
        compress_openvino_weights(fp32["text"], os.path.join(staging, names["text"]))
        methods = {"image": "nncf quantize (transformer model type)", "text": "nncf compress_weights (int8_asym)"}
    for tower in TOWERS:
        manifest["graphs"][tower]["int8"] = names[tower]
    manifest["quantization"] = methods
