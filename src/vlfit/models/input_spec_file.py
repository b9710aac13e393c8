"""The inputs a run was trained on, saved beside its weights (``input_spec.json``): the one record every door reads.

Training (and every command that writes a model folder: ``merge-lora``, ``wise-ft``) saves it with the tokenizer
and image processor (``vlfit.models.loading.save_inputs``); ``vlfit export`` copies it into its manifest. Loading a
folder (``resolve_model``) takes the caption length from it, so ``vlfit.load``, ``retrieve``, ``serve``, ``export``,
``vqa`` and ``fewshot`` cut captions where training cut them. A folder without one (a hub checkpoint, or a run saved
before the record existed) is read as before: ``DEFAULT_MAX_SEQ_LENGTH``, within the model's text positions.

The image settings are recorded too (size, resize and crop, normalisation; a NaFlex model's token budget and patch
size instead of a crop): they are the config's and the image processor's, and a record that disagrees with them is
refused rather than guessed between.

    {"format_version": 1, "max_seq_length": 16, "tokenizer_call": {"truncation": true, "padding": "longest"},
     "image_size": 224, "resize": "shortest_edge", "resample": "bicubic", "crop": "center",
     "image_mean": [...], "image_std": [...]}
"""

from __future__ import annotations

import math
import os
from typing import Any

from vlfit.errors import ModelLoadError
from vlfit.models.family import InputSpec
from vlfit.models.folder_record import read_folder_record, save_folder_record

INPUT_SPEC_FILE = "input_spec.json"
FORMAT_VERSION = 1
# The caption length vlfit train truncates to by default (--max_seq_length), and what a folder without a record
# is read at.
DEFAULT_MAX_SEQ_LENGTH = 128
# What vlfit's input pipeline does to an image (``vlfit.data.image_transforms.resize_crop_uint8``): the short side
# resized (bicubic), then the center cropped to a square. The only geometry vlfit trains with.
IMAGE_GEOMETRY = {"resize": "shortest_edge", "resample": "bicubic", "crop": "center"}
# A NaFlex model's (``vlfit.data.naflex``): each image resized, bilinear, to the patch grid its aspect ratio gets
# within ``max_num_patches``, uncropped.
PATCH_GEOMETRY = {"resize": "patch_budget", "resample": "bilinear", "crop": "none"}
# How every caption is tokenized (``vlfit.models.family.tokenize_captions``), ``max_length`` aside.
TOKENIZER_CALL = {"truncation": True, "padding": "longest"}


def input_settings(inputs: InputSpec) -> dict[str, Any]:
    """The record of ``inputs``: what ``input_spec.json`` holds."""
    naflex = inputs.max_num_patches is not None
    record = {
        "format_version": FORMAT_VERSION,
        "max_seq_length": int(inputs.max_seq_length),
        "tokenizer_call": dict(TOKENIZER_CALL),
        "image_size": int(inputs.image_size),
        **(PATCH_GEOMETRY if naflex else IMAGE_GEOMETRY),
    }
    if naflex:  # the token budget the run trained with, which every door reads back
        record.update(max_num_patches=int(inputs.max_num_patches), patch_size=int(inputs.patch_size or 0))  # type: ignore[arg-type]
    record.update(image_mean=[float(x) for x in inputs.image_mean], image_std=[float(x) for x in inputs.image_std])
    if inputs.matryoshka_dims:  # the prefix sizes it was trained at (vlfit.models.matryoshka)
        record["matryoshka_dims"] = [int(size) for size in inputs.matryoshka_dims]
    return record


def save_input_settings(inputs: InputSpec, folder: str) -> None:
    """Write ``input_spec.json`` into a model folder."""
    save_folder_record(folder, INPUT_SPEC_FILE, input_settings(inputs))


def read_input_settings(folder: str | None) -> dict[str, Any] | None:
    """The record a model folder holds, checked; None for no folder or a folder without one.

    Raises:
        ModelLoadError: naming the file, for a record that is not JSON, of a newer format, or without a positive
            ``max_seq_length``.
    """
    found = read_folder_record(
        folder,
        INPUT_SPEC_FILE,
        format_version=FORMAT_VERSION,
        what="the run's input settings",
        remedy="delete the file to load the model at the default caption length, or save the model again",
        newer="input settings of an unknown format; upgrade vlfit to load this model",
    )
    if found is None:
        return None
    path, record = found
    length = record.get("max_seq_length")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ModelLoadError(f"{path}: max_seq_length must be a positive integer, got {length!r}")
    geometry = {key: record.get(key, value) for key, value in IMAGE_GEOMETRY.items()}
    budget = record.get("max_num_patches")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ModelLoadError(f"{path}: max_num_patches must be a positive integer, got {budget!r}")
    expected = IMAGE_GEOMETRY if budget is None else PATCH_GEOMETRY
    if geometry != expected:
        raise ModelLoadError(f"{path}: images resized as {geometry}, which vlfit does not do ({expected})")
    sizes = record.get("matryoshka_dims", [])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise ModelLoadError(f"{path}: matryoshka_dims must be a list of positive integers, got {sizes!r}")
    return record


def check_image_settings(record: dict[str, Any], inputs: InputSpec, path: str) -> None:
    """Refuse a record whose image size, mean or std disagree with the config's and the image processor's.

    Raises:
        ModelLoadError: naming ``path`` and both values.
    """
    saved = {"image_size": record.get("image_size"), "image_mean": record.get("image_mean"),
             "image_std": record.get("image_std")}  # fmt: skip
    found = {"image_size": inputs.image_size, "image_mean": list(inputs.image_mean),
             "image_std": list(inputs.image_std)}  # fmt: skip
    for key, value in saved.items():
        if value is None:
            continue
        same = value == found[key] if key == "image_size" else _close(value, found[key])
        if not same:
            raise ModelLoadError(
                f"{os.path.join(path, INPUT_SPEC_FILE)}: {key} {value} differs from the model's {found[key]} "
                "(config.json, preprocessor_config.json); save the model again with vlfit, or fix the file"
            )


def _close(a: Any, b: list[float]) -> bool:
    if not isinstance(a, list) or len(a) != len(b):
        return False
    return all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a, b, strict=True))
