"""The output short side of ``vlfit prepare``: from ``--short_side``, a preset, or a checkpoint's vision config."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig

from vlfit.errors import DataError
from vlfit.models.registry import family_for_preset


def resolve_short_side(
    short_side: int | None = None,
    model_preset: str | None = None,
    model_name_or_path: str | None = None,
    *,
    cache_dir: str | None = None,
    revision: str = "main",
    token: str | None = None,
) -> int:
    """Find the output short side from exactly one of: a number, a preset, or a checkpoint's vision config.

    Args:
        short_side: The short side in pixels.
        model_preset: A preset name (``vlfit.models.registry``); its image size is used.
        model_name_or_path: A checkpoint (local folder or hub id); its ``vision_config.image_size`` is used.
        cache_dir: Where downloaded configs are cached.
        revision: Checkpoint branch, tag or commit.
        token: Hub token.

    Returns:
        The short side in pixels.

    Raises:
        ValueError: when none or several of the three are given, the preset is unknown, the checkpoint's config
            cannot be loaded or has no image size, or the size is not positive.
    """
    given = [
        flag
        for flag, value in (
            ("--short_side", short_side),
            ("--model_preset", model_preset),
            ("--model_name_or_path", model_name_or_path),
        )
        if value is not None
    ]
    if len(given) != 1:
        found = f"got {' and '.join(given)}" if given else "got none"
        raise DataError(
            "give exactly one of --short_side (pixels), --model_preset (its image size) or --model_name_or_path "
            f"(its vision_config.image_size) to set the output short side; {found}"
        )
    if model_preset is not None:
        family = family_for_preset(model_preset)
        size: Any = family.image_size(family.preset_config(model_preset))
    elif model_name_or_path is not None:
        size = _checkpoint_image_size(model_name_or_path, cache_dir=cache_dir, revision=revision, token=token)
    else:
        size = short_side
    size = int(size)
    if size < 1:
        raise DataError(f"the output short side must be at least 1 pixel, got {size} (from {given[0]})")
    return size


def resolve_patch_budget(
    model_preset: str | None = None,
    model_name_or_path: str | None = None,
    *,
    cache_dir: str | None = None,
    revision: str = "main",
    token: str | None = None,
) -> tuple[int, int] | None:
    """A NaFlex model's ``(patch_size, max_num_patches)`` (its run's record, else its image processor's), or None for
    a model of square images or none given (``--short_side``)."""
    from vlfit.models.input_spec_file import read_input_settings
    from vlfit.models.registry import family_for_config

    if model_preset is not None:
        family = family_for_preset(model_preset)
        budget = family.max_num_patches(family.preset_image_processor(model_preset))
        config = family.preset_config(model_preset)
    elif model_name_or_path is not None:
        from transformers import AutoImageProcessor

        hub = {"cache_dir": cache_dir, "revision": revision, "token": token}
        try:
            config = AutoConfig.from_pretrained(model_name_or_path, **hub)
            family = family_for_config(config)
            budget = family.max_num_patches(AutoImageProcessor.from_pretrained(model_name_or_path, **hub))
        except (OSError, ValueError) as err:
            raise DataError(f"--model_name_or_path {model_name_or_path!r}: cannot load it: {err}") from err
        record = read_input_settings(model_name_or_path) if os.path.isdir(model_name_or_path) else None
        if budget is not None and record is not None and record.get("max_num_patches"):
            budget = int(record["max_num_patches"])
    else:
        return None
    if budget is None:
        return None
    return int(family.patch_size(config)), int(budget)  # type: ignore[arg-type]


def _checkpoint_image_size(model_name_or_path: str, *, cache_dir: str | None, revision: str, token: str | None) -> int:
    try:
        config = AutoConfig.from_pretrained(model_name_or_path, cache_dir=cache_dir, revision=revision, token=token)
    except (OSError, ValueError) as err:
        raise DataError(f"--model_name_or_path {model_name_or_path!r}: cannot load its config: {err}") from err
    vision = getattr(config, "vision_config", None)
    size = getattr(vision if vision is not None else config, "image_size", None)
    if size is None:
        raise DataError(
            f"--model_name_or_path {model_name_or_path!r}: its config has no vision_config.image_size; "
            "pass --short_side instead"
        )
    if isinstance(size, (list, tuple)):  # (height, width): the short side must cover both
        size = min(size)
    return int(size)
