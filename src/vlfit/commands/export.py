"""``vlfit export``: a checkpoint's two towers as ONNX or OpenVINO graphs (optionally INT8), as the CLIP model
folder Immich loads (``--format immich``), or as the folder open_clip loads (``--format open_clip``), checked against
PyTorch."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from vlfit.arguments.runtime import runtime_arguments
from vlfit.commands.parsing import CommandParser
from vlfit.data.sources.openers import open_split
from vlfit.data.sources.synthetic import synthetic_source
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.inference.backends import TorchEncoder
from vlfit.inference.export import (
    DEFAULT_OPSET,
    ITM_PARITY_TOLERANCE,
    PARITY_THRESHOLD,
    ExportSettings,
    check_output_dir,
    export_model,
)
from vlfit.inference.export_samples import Samples, load_samples
from vlfit.inference.runtime import ModelRuntime

logger = logging.getLogger(__name__)

# The long side of synthetic parity and calibration images, in pixels: photo-sized, quick to make.
SYNTHETIC_LONG_SIDE = (160, 320)


@dataclass
class ExportArguments(runtime_arguments("max_seq_length", "max_num_patches")):
    """Flags of ``vlfit export``."""

    model_name_or_path: str = flag(help="The checkpoint folder to export (vlfit train's output).")
    output_dir: str = flag(help="Folder for the graphs, the tokenizer and export_manifest.json.")
    format: Literal["onnx", "openvino", "immich", "open_clip"] = flag(
        "onnx",
        "onnx (ONNX Runtime), openvino (OpenVINO IR), immich: the CLIP model folder Immich's "
        "machine-learning service loads (config.json, textual/ and visual/ ONNX graphs, the tokenizer and "
        "preprocess_cfg.json), or open_clip: the folder open_clip.create_model_and_transforms('local-dir:"
        "FOLDER') and get_tokenizer load (open_clip_config.json, open_clip_model.safetensors, the "
        "tokenizer; CLIP and MetaCLIP 2 runs; the open_clip extra), for clip-retrieval and "
        "clip-as-service (docs/export-retrieval.md).",
    )
    quantize: str | None = flag(
        None,
        "int8: also write INT8 graphs (ONNX Runtime: dynamic for the text tower, static MatMul-only "
        "for the image tower; OpenVINO: NNCF post-training quantization), calibrated on real images.",
    )
    calibration_dataset: str | None = flag(
        None,
        "Dataset (any form --dataset_name of vlfit train takes: hub id, folder, data files, tar shards) "
        "whose samples calibrate INT8 and measure "
        "parity; without one, synthetic scenes (vlfit make-data's) are made on the spot.",
    )
    calibration_split: str = flag("train", "Split of --calibration_dataset to read.")
    calibration_samples: int = flag(300, "Images (and captions) INT8 calibrates on.")
    parity_samples: int = flag(
        64,
        "Samples the parity and accuracy figures are measured on (read before the calibration "
        "samples, so the two do not overlap when the split is large enough).",
    )
    image_column: str = flag("image", "Image column of --calibration_dataset.")
    caption_column: str = flag("image_description", "Caption column of --calibration_dataset.")
    image_id_column: str | None = flag(
        None,
        "Column of --calibration_dataset naming the image a row shows: the accuracy figures are recall "
        "over unique images, as vlfit eval's (default: rows with identical image bytes are one image).",
    )
    opset: int = flag(DEFAULT_OPSET, "ONNX opset of the graphs.")
    parity_threshold: float = flag(
        PARITY_THRESHOLD, "Refuse to write graphs whose fp32 embeddings have a cosine to PyTorch's below this."
    )
    itm_tolerance: float = flag(
        ITM_PARITY_TOLERANCE,
        "Refuse to write the matching graph (itm.onnx, for a BridgeTower model with an image-text "
        "matching head) when its fp32 log-odds differ from PyTorch's by more than this, or order a caption's "
        "candidates otherwise.",
    )
    dataloader_num_workers: int = flag(0, "Loader workers decoding the samples.")
    json: bool = flag(False, "Print the summary as JSON instead of lines of text.")


def _samples(args: ExportArguments, spec) -> tuple[Samples, Samples | None]:
    needed = args.parity_samples + (args.calibration_samples if args.quantize else 0)
    if args.calibration_dataset:
        source = open_split(
            args.calibration_dataset,
            args.calibration_split,
            image_column=args.image_column,
            caption_column=args.caption_column,
            image_id_column=args.image_id_column,
        )
    else:
        source = synthetic_source(needed, min_long_side=SYNTHETIC_LONG_SIDE[0], max_long_side=SYNTHETIC_LONG_SIDE[1])
    parity_rows = range(min(args.parity_samples, len(source)))
    parity = load_samples(source.select(parity_rows), spec, num_workers=args.dataloader_num_workers, progress="parity")
    if not args.quantize:
        return parity, None
    calibration_rows = range(len(parity_rows), min(needed, len(source)))
    if not calibration_rows:
        logger.warning("%s has no samples beyond the parity ones: calibrating on those", source.name)
        return parity, parity
    return parity, load_samples(
        source.select(calibration_rows), spec, num_workers=args.dataloader_num_workers, progress="calibration"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit export`` (``argv`` None reads ``sys.argv[1:]``)."""
    parser = CommandParser(
        ExportArguments,
        prog="vlfit export",
        description="Export a checkpoint's image tower (uint8 pixels -> L2-normalized embedding) and text tower "
        "(input ids, attention mask -> L2-normalized embedding) with dynamic batch and sequence axes, checked "
        "against PyTorch on real samples; with --format immich, the CLIP model folder Immich's machine-learning "
        "service loads; with --format open_clip, the folder open_clip's create_model_and_transforms loads.",
    )
    (args,) = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    if args.parity_samples < 1 or args.calibration_samples < 1:
        raise ConfigError(
            f"--parity_samples and --calibration_samples must be at least 1, got {args.parity_samples} and "
            f"{args.calibration_samples}"
        )
    if args.format == "immich":
        return _export_immich(args)
    if args.format == "open_clip":
        return _export_open_clip(args)
    settings = ExportSettings(args.format, args.quantize, args.opset, args.parity_threshold, args.itm_tolerance)
    check_output_dir(args.model_name_or_path, args.output_dir)
    loaded = ModelRuntime.open(args.model_name_or_path, args.settings(backend="torch"), flag="--model_name_or_path",
                               kinds=("checkpoint", "adapters")).encoder  # fmt: skip
    assert isinstance(loaded, TorchEncoder)  # a checkpoint runs on torch
    parity, calibration = _samples(args, loaded.spec)
    manifest = export_model(loaded, args.output_dir, settings, parity_samples=parity, calibration_samples=calibration)
    summary = {
        "output_dir": args.output_dir,
        "format": manifest["format"],
        "graphs": manifest["graphs"],
        "parity": manifest["parity"],
        "accuracy": manifest["accuracy"],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_export_summary(summary)
    return 0


def _layout_inputs(
    args: ExportArguments, writes: str, refusal_of: Callable[[TorchEncoder], str | None]
) -> tuple[TorchEncoder, Samples]:
    """The checkpoint and parity samples of a folder in another tool's layout (``--format immich``, ``open_clip``),
    refused in one line (``refusal_of``: why that tool cannot load it) before any sample is read."""
    if args.quantize:
        raise ConfigError(f"--format {args.format} writes {writes}; leave --quantize out")
    check_output_dir(args.model_name_or_path, args.output_dir)
    loaded = ModelRuntime.open(args.model_name_or_path, args.settings(backend="torch"), flag="--model_name_or_path",
                               kinds=("checkpoint", "adapters")).encoder  # fmt: skip
    assert isinstance(loaded, TorchEncoder)  # a checkpoint runs on torch
    refusal = refusal_of(loaded)
    if refusal is not None:
        raise ConfigError(f"--format {args.format}: {refusal}")
    samples, _ = _samples(args, loaded.spec)
    return loaded, samples


def _export_immich(args: ExportArguments) -> int:
    """``vlfit export --format immich`` (``vlfit.inference.export_immich``)."""
    from vlfit.inference.export_immich import export_immich, immich_refusal

    loaded, samples = _layout_inputs(args, "the fp32 graphs Immich loads", immich_refusal)
    record = export_immich(loaded, args.output_dir, parity_samples=samples, opset=args.opset,
                           parity_threshold=args.parity_threshold)  # fmt: skip
    summary = _layout_summary(args, record["parity"], record["text"]["context_length"], loaded.spec.image_size)
    if summary is not None:
        samples, figures = summary
        print(f"immich graphs: lowest cosine to PyTorch's embeddings on {samples} samples (captions tokenized as "
              f"Immich tokenizes them): {figures}")  # fmt: skip
        print(f"wrote {args.output_dir}: Immich's CLIP model folder (config.json, textual/model.onnx with its "
              f"tokenizer, visual/model.onnx with preprocess_cfg.json; {loaded.spec.image_size} px images, "
              f"{record['text']['context_length']}-token captions)")  # fmt: skip
    return 0


def _export_open_clip(args: ExportArguments) -> int:
    """``vlfit export --format open_clip`` (``vlfit.inference.export_open_clip``)."""
    from vlfit.extras import require_extra
    from vlfit.inference.export_open_clip import export_open_clip, open_clip_refusal

    require_extra("open_clip", "--format open_clip")
    loaded, samples = _layout_inputs(args, "the fp32 weights open_clip loads", open_clip_refusal)
    record = export_open_clip(loaded, args.output_dir, parity_samples=samples, parity_threshold=args.parity_threshold)
    context = record["open_clip_config"]["model_cfg"]["text_cfg"]["context_length"]
    summary = _layout_summary(args, record["parity"], context, loaded.spec.image_size)
    if summary is not None:
        samples, figures = summary
        print(f"open_clip: lowest cosine of open_clip's embeddings (its loader and tokenizer) to vlfit's on {samples} "
              f"samples: {figures}")  # fmt: skip
        print(f"wrote {args.output_dir}: open_clip_config.json, open_clip_model.safetensors and the tokenizer "
              f"({loaded.spec.image_size} px images, {context}-token captions); load it with "
              f"open_clip.create_model_and_transforms('local-dir:{args.output_dir}')")  # fmt: skip
    return 0


def _layout_summary(
    args: ExportArguments, parity: dict, context_length: int, image_size: int
) -> tuple[int, str] | None:
    """Print the summary of a folder in another tool's layout as JSON (``--json``: None), or return its parity
    samples and figures (``image C, text C``) for the format's lines."""
    if args.json:
        print(json.dumps({"output_dir": args.output_dir, "format": args.format, "parity": parity,
                          "context_length": context_length, "image_size": image_size}, indent=1))  # fmt: skip
        return None
    towers = {tower: parity[tower]["min_cosine"] for tower in ("image", "text")}
    return parity["samples"], _figures(towers)


def _figures(values: dict) -> str:  # the manifest's figures are rounded already: as they are stored
    return ", ".join(f"{key} {value}" for key, value in values.items())


def print_export_summary(summary: dict) -> None:
    """``vlfit export``'s summary as lines of text, ending with what was written."""
    parity = summary["parity"]
    for precision in ("fp32", "int8"):
        if precision in parity:
            towers = {tower: parity[precision][tower]["min_cosine"] for tower in ("image", "text")}
            print(f"{precision} graphs: lowest cosine to PyTorch's embeddings on {parity['samples']} samples: "
                  f"{_figures(towers)}")  # fmt: skip
    for name, figures in summary["accuracy"].items():
        if isinstance(figures, dict):
            print(f"{name}: {_figures(figures)}")
    graphs = [name for tower in summary["graphs"].values() for name in tower.values()]
    print(f"wrote {summary['output_dir']}: {summary['format']} graphs {', '.join(graphs)}, the tokenizer and "
          "export_manifest.json")  # fmt: skip
