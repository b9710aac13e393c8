"""``vlfit export --format immich``: a checkpoint as the CLIP model folder Immich's machine-learning service loads.

The layout is the one Immich's ``immich_ml/models/clip`` (``textual.py``, ``visual.py``) reads, as of Immich v2.2
(the same as the v1 releases' ``app/models/clip``)::

    config.json                    open_clip's model config: embed_dim, vision_cfg.image_size, text_cfg.context_length
    textual/model.onnx             input "text", int32 [1, context] -> output "embedding", float32 [1, D]
    textual/tokenizer.json         the run's tokenizer, for the ``tokenizers`` library
    textual/tokenizer_config.json  its "pad_token" (Immich pads every caption to context_length with it)
    visual/model.onnx              input "image", float32 [1, 3, S, S] (normalized) -> output "embedding"
    visual/preprocess_cfg.json     size, mean, std, interpolation, resize_mode
    vlfit_export.json              what was exported from what, and the parity measured (Immich ignores it)

Everything comes from the run's own inputs (``input_spec.json``, as every door reads it): the caption length is the
context length, the image size, mean and std and the resize (``shortest``: the short side resized bicubic, the
center cropped, as vlfit's pipeline does) are the run's. Immich tokenizes with the ``tokenizers`` library (the
whitespace collapsed, truncated to the context length, padded to it with the pad token) and sends no attention
mask: the text graph rebuilds vlfit's mask from the ids (every token up to the padding; where the pad token is also
a special token a caption ends with, as in OpenAI's CLIP tokenizer, that first one counts as a token), so each
caption embeds as vlfit embeds it. Both graphs L2-normalize, as vlfit's do.

The graphs are traced from the family's towers (``ModelFamily.encode_image`` / ``encode_text``), as ``vlfit export``
traces its own, so any family whose towers that export writes works: CLIP, SigLIP and BridgeTower (whose contrastive
heads embed each side alone). A NaFlex model (SigLIP 2 at its own aspect ratios) is refused: Immich feeds square
images of one size. Like ``vlfit export``, the folder is staged and moved in only once the graphs' embeddings match
PyTorch's on real samples (``--parity_threshold``), the texts tokenized as Immich tokenizes them.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from vlfit.atomic_files import write_text_atomically
from vlfit.data.normalize import normalize_uint8
from vlfit.errors import ConfigError
from vlfit.inference.backends import TorchEncoder
from vlfit.inference.export import check_output_dir, cosine_figures
from vlfit.inference.export_samples import Samples
from vlfit.inference.exported import check_parity
from vlfit.inference.identity import library_versions
from vlfit.inference.staging import fp32_bytes, staged_export
from vlfit.models.input_spec_file import input_settings

logger = logging.getLogger(__name__)

IMMICH_LAYOUT = "Immich machine-learning v2.2 (immich_ml/models/clip: textual.py, visual.py)"
CONFIG_NAME = "config.json"
TEXTUAL, VISUAL = "textual", "visual"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
PREPROCESS_NAME = "preprocess_cfg.json"
RECORD_NAME = "vlfit_export.json"  # written last: a folder with it is whole
TEXT_INPUT, IMAGE_INPUT, OUTPUT = "text", "image", "embedding"
# vlfit's image geometries (input_spec.json: resize, crop, resample) that open_clip's preprocess config, which Immich
# reads, can say: its resize_mode and interpolation. vlfit's other one, NaFlex's per-image patch grid, has none.
IMMICH_RESIZES = {("shortest_edge", "center", "bicubic"): ("shortest", "bicubic")}


class ImmichVisual(nn.Module):
    """Normalized float32 pixels ``[1, 3, S, S]`` -> the L2-normalized image embedding (what Immich feeds)."""

    def __init__(self, loaded: TorchEncoder) -> None:
        super().__init__()
        self.family = loaded.loaded.family
        self.model = loaded.loaded.model

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.family.encode_image(self.model, image)


class ImmichTextual(nn.Module):
    """int32 token ids ``[1, context]``, padded with ``pad_id`` -> the L2-normalized caption embedding.

    The attention mask vlfit tokenizes with is rebuilt from the ids: a position is a token while the pad ids up to
    it number at most ``pad_ids_in_a_caption`` (the pad id a caption itself holds, as OpenAI's CLIP tokenizer ends
    every caption with it), padding after that.
    """

    def __init__(self, loaded: TorchEncoder, pad_id: int, pad_ids_in_a_caption: int) -> None:
        super().__init__()
        self.family = loaded.loaded.family
        self.model = loaded.loaded.model
        self.pad_id = pad_id
        self.pad_ids_in_a_caption = pad_ids_in_a_caption

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        ids = text.to(torch.int64)
        pads_so_far = (ids == self.pad_id).to(torch.int64).cumsum(dim=1)
        mask = (pads_so_far <= self.pad_ids_in_a_caption).to(torch.int64)
        return self.family.encode_text(self.model, ids, mask)


def immich_refusal(loaded: TorchEncoder) -> str | None:
    """Why ``loaded`` cannot be exported for Immich (None: it can), in one line."""
    spec = loaded.spec
    settings = input_settings(spec)
    if immich_resize(settings) is None:
        how = f"{settings['resize']}/{settings['crop']}/{settings['resample']}"
        if spec.max_num_patches is not None:
            return (f"{loaded.model_path} embeds images at their own aspect ratio (NaFlex, max_num_patches "
                    f"{spec.max_num_patches}), and Immich feeds square images of one size (resized {how} is not an "
                    "Immich resize): export it with --format onnx, or train a model of fixed-size images for "
                    "Immich")  # fmt: skip
        return (f"{loaded.model_path} resizes images as {how}, which Immich's preprocess_cfg.json cannot say: export "
                "it with --format onnx")  # fmt: skip
    tokenizer = spec.tokenizer
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return (f"{loaded.model_path}: its tokenizer ({type(tokenizer).__name__}) has no tokenizer.json for the "
                "tokenizers library Immich reads it with; save the model with a fast tokenizer")  # fmt: skip
    if tokenizer.pad_token is None:
        return f"{loaded.model_path}: its tokenizer has no pad token, which Immich pads every caption with"
    return None


def immich_resize(settings: dict[str, Any]) -> tuple[str, str] | None:
    """Immich's ``resize_mode`` and ``interpolation`` for the image geometry of ``settings`` (``input_spec.json``'s
    record), or None when Immich has none that reproduces it."""
    return IMMICH_RESIZES.get((settings["resize"], settings["crop"], settings["resample"]))


def _bare_tokenizer(loaded: TorchEncoder) -> Any:
    """The run's ``tokenizers.Tokenizer`` without the padding and truncation a tokenizer call may have left set."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(loaded.spec.tokenizer.backend_tokenizer.to_str())
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def preprocess_config(loaded: TorchEncoder) -> dict[str, Any]:
    """``visual/preprocess_cfg.json``: open_clip's preprocess config from the run's input settings."""
    settings = input_settings(loaded.spec)
    size = settings["image_size"]
    resize = immich_resize(settings)
    assert resize is not None, "refused by immich_refusal"
    return {
        "size": [size, size],
        "mode": "RGB",
        "mean": settings["image_mean"],
        "std": settings["image_std"],
        "interpolation": resize[1],
        "resize_mode": resize[0],
        "fill_color": 0,
    }


def open_clip_config(loaded: TorchEncoder, vocab_size: int) -> dict[str, Any]:
    """``config.json``: open_clip's model config, with what Immich reads (``text_cfg.context_length``) and what
    describes the towers."""
    spec, config = loaded.spec, loaded.loaded.model.config
    vision = getattr(config, "vision_config", None)
    vision_cfg: dict[str, Any] = {"image_size": spec.image_size}
    if getattr(vision, "patch_size", None):
        vision_cfg["patch_size"] = vision.patch_size
    return {
        "embed_dim": loaded.identity.embedding_size,
        "vision_cfg": vision_cfg,
        "text_cfg": {"context_length": spec.max_seq_length, "vocab_size": vocab_size},
    }


def tokenizer_config(loaded: TorchEncoder) -> dict[str, Any]:
    """``textual/tokenizer_config.json``: the special tokens as strings (Immich reads ``pad_token``)."""
    tokenizer = loaded.spec.tokenizer
    config: dict[str, Any] = {"model_max_length": loaded.spec.max_seq_length}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            config[name] = str(token)
    return config


def immich_token_ids(folder: str, texts: list[str]) -> np.ndarray:
    """``texts`` as Immich's ``OpenClipTextualEncoder`` tokenizes them from ``folder``: the whitespace collapsed,
    ``tokenizer.json`` truncated and padded to ``text_cfg.context_length`` with ``tokenizer_config.json``'s pad
    token; int32 ``[len(texts), context]``."""
    from tokenizers import Tokenizer

    with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as f:
        context = int(json.load(f)["text_cfg"].get("context_length", 77))
    with open(os.path.join(folder, TEXTUAL, TOKENIZER_CONFIG), encoding="utf-8") as f:
        pad_token = json.load(f)["pad_token"]
    tokenizer = Tokenizer.from_file(os.path.join(folder, TEXTUAL, TOKENIZER_FILE))
    tokenizer.enable_padding(length=context, pad_token=pad_token, pad_id=tokenizer.token_to_id(pad_token))
    tokenizer.enable_truncation(max_length=context)
    return np.array([tokenizer.encode(" ".join(text.split())).ids for text in texts], dtype=np.int32)


def _rename_output(program: Any, name: str) -> None:
    """Name the graph's one output ``name``: a value of the graph already called so (the exporter names values after
    their operations: ``embedding`` is aten.embedding's) is renamed first."""
    graph = program.model.graph
    output = graph.outputs[0]
    values = [*graph.inputs, *graph.initializers.values(), *(value for node in graph for value in node.outputs)]
    taken = {value.name for value in values}
    for value in values:
        if value.name == name and value is not output:
            value.name = next(f"{name}_{i}" for i in range(1, len(taken) + 2) if f"{name}_{i}" not in taken)
    output.name = name


def _trace(module: nn.Module, example: torch.Tensor, input_name: str, path: str, opset: int) -> None:
    """``module`` as an ONNX graph of static shape (Immich feeds one item of one shape) at ``path``."""
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.onnx")
        program = torch.onnx.export(module.eval(), (example,), input_names=[input_name], output_names=["output"],
                                    opset_version=opset, dynamo=True, verbose=False)  # fmt: skip
        _rename_output(program, OUTPUT)
        program.save(path)


def _parity(staging: str, loaded: TorchEncoder, samples: Samples) -> dict[str, dict[str, float]]:
    """Cosines of the staged graphs' embeddings to PyTorch's: the samples' pixels (vlfit's pipeline, normalized as
    Immich normalizes) and captions (tokenized as Immich tokenizes them from the folder)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    visual = ort.InferenceSession(os.path.join(staging, VISUAL, MODEL_FILE), options, ["CPUExecutionProvider"])
    textual = ort.InferenceSession(os.path.join(staging, TEXTUAL, MODEL_FILE), options, ["CPUExecutionProvider"])
    mean, std = (torch.tensor(stat, dtype=torch.float32) for stat in (loaded.spec.image_mean, loaded.spec.image_std))
    images = normalize_uint8(samples.pixels, mean, std).numpy()
    graph_images = np.concatenate([visual.run(None, {IMAGE_INPUT: images[i : i + 1]})[0] for i in range(len(images))])
    ids = immich_token_ids(staging, list(samples.captions))
    graph_texts = np.concatenate([textual.run(None, {TEXT_INPUT: ids[i : i + 1]})[0] for i in range(len(ids))])
    reference_images = torch.cat([loaded.encode_images(samples.pixels[i : i + 8]) for i in range(0, len(images), 8)])
    reference_texts = torch.cat([loaded.encode_texts(samples.captions[i : i + 8]) for i in range(0, len(ids), 8)])
    return {
        "image": cosine_figures(reference_images, torch.from_numpy(graph_images)),
        "text": cosine_figures(reference_texts, torch.from_numpy(graph_texts)),
    }


def write_layout_record(
    staging: str,
    loaded: TorchEncoder,
    *,
    fmt: str,
    layout: str,
    details: dict[str, Any],
    parity: dict[str, dict[str, float]],
    parity_samples: Samples,
    parity_threshold: float,
    seconds: float,
    libraries: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Check an export in the open_clip layout (Immich's or open_clip's own) against PyTorch and write its record
    (``RECORD_NAME``) into ``staging``, last; returns the record.

    Args:
        fmt, layout: The ``--format`` and the layout it follows (whose loader reads it).
        details: The format's own entries (its config, its text settings).
        parity: Per tower, ``cosine_figures`` of the staged files' embeddings against PyTorch's.
        libraries: Versions beside ``library_versions()``'s.

    Raises:
        ExportParityError: a tower below ``parity_threshold`` (``check_parity``); nothing is written.
    """
    check_parity(parity, parity_threshold, len(parity_samples), f"the {fmt} export's {{tower}}")
    record = {
        "format_version": 1,
        "format": fmt,
        "layout": layout,
        "identity": loaded.identity.to_dict(),
        "input_spec": input_settings(loaded.spec),
        **details,
        "parity": {"samples": len(parity_samples), "threshold": parity_threshold, **parity},
        "export_seconds": seconds,
        "libraries": {**library_versions(), **(libraries or {})},
        "source": {
            "path": os.path.abspath(loaded.model_path),
            "sha256": loaded.identity.checkpoint_sha256,
            "exported_at": time.time(),
        },
    }
    write_text_atomically(os.path.join(staging, RECORD_NAME), json.dumps(record, indent=1) + "\n")
    return record


def export_immich(
    loaded: TorchEncoder, output_dir: str, *, parity_samples: Samples, opset: int, parity_threshold: float
) -> dict[str, Any]:
    """Write Immich's CLIP model folder of ``loaded`` into ``output_dir`` (see the module).

    Returns:
        The record written (``vlfit_export.json``): identity, inputs, parity.

    Raises:
        ConfigError: for a model Immich cannot run (``immich_refusal``).
        ExportParityError: when a graph's cosine to PyTorch is below ``parity_threshold``; nothing is written.
        WriteFailedError: when a write fails while staged; nothing in ``output_dir`` is replaced.
    """
    check_output_dir(loaded.model_path, output_dir)
    refusal = immich_refusal(loaded)
    if refusal is not None:
        raise ConfigError(f"--format immich: {refusal}")
    spec = loaded.spec
    tokenizer = _bare_tokenizer(loaded)
    pad_token = str(spec.tokenizer.pad_token)
    pad_id = tokenizer.token_to_id(pad_token)
    pad_ids_in_a_caption = tokenizer.encode("a").ids.count(pad_id)  # the special tokens a caption gets
    with staged_export(output_dir, RECORD_NAME, expected_bytes=fp32_bytes(loaded.model)) as staging:
        for part in (TEXTUAL, VISUAL):
            os.makedirs(os.path.join(staging, part))
        started = time.perf_counter()
        image = torch.zeros(1, 3, spec.image_size, spec.image_size, dtype=torch.float32)
        _trace(ImmichVisual(loaded), image, IMAGE_INPUT, os.path.join(staging, VISUAL, MODEL_FILE), opset)
        text = torch.full((1, spec.max_seq_length), pad_id, dtype=torch.int32)
        textual = ImmichTextual(loaded, pad_id, pad_ids_in_a_caption)
        _trace(textual, text, TEXT_INPUT, os.path.join(staging, TEXTUAL, MODEL_FILE), opset)
        tokenizer.save(os.path.join(staging, TEXTUAL, TOKENIZER_FILE))
        for path, content in (
            ((TEXTUAL, TOKENIZER_CONFIG), tokenizer_config(loaded)),
            ((VISUAL, PREPROCESS_NAME), preprocess_config(loaded)),
            ((CONFIG_NAME,), open_clip_config(loaded, tokenizer.get_vocab_size())),
        ):
            write_text_atomically(os.path.join(staging, *path), json.dumps(content, indent=2) + "\n")
        return write_layout_record(
            staging,
            loaded,
            fmt="immich",
            layout=IMMICH_LAYOUT,
            details={
                "text": {"context_length": spec.max_seq_length, "pad_token": pad_token, "pad_id": pad_id},
                "opset": opset,
            },
            parity=_parity(staging, loaded, parity_samples),
            parity_samples=parity_samples,
            parity_threshold=parity_threshold,
            seconds=round(time.perf_counter() - started, 1),
        )
