"""LoRA through ``peft``: ``--lora_r`` and friends put low-rank adapters on a model's linear layers.

Targets are named groups (``text``, ``vision``, ``cross``: the towers each family names in ``module_groups``) or
module names (a full name, or the last part of one: ``query``, ``v_proj``); only ``nn.Linear`` modules get
adapters. The family's projection heads into the shared space (``head_modules``) are trained in full beside the
adapters and saved with them: they are small and start far from useful on a new task. Everything else, the
temperature included, stays as the checkpoint has it.

A run saves what ``peft`` saves (``adapter_config.json``, ``adapter_model.safetensors``: adapters and heads only)
with the tokenizer and image processor. The adapters' base is the checkpoint the run started from; a preset has
none on disk, so its random initial weights are saved once in ``<output_dir>/base_model`` and the adapters point
there. Loading a folder of adapters (``vlfit eval``, ``export``, ``retrieve``, ``vlfit merge-lora``) loads the base
and merges the adapters into it: the plain model, computing what the adapted one computes (``vlfit.models.reference``
tells such a folder apart and finds its base).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.models.family import ModelFamily

BASE_MODEL_DIR = "base_model"


@dataclass(frozen=True)
class LoraSettings:
    """``--lora_r``, ``--lora_alpha`` (default ``2 * r``), ``--lora_dropout`` and ``--lora_target``."""

    r: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # empty: every group the family has


def target_modules(
    family: ModelFamily, model: nn.Module, targets: Sequence[str], heads: Sequence[str] | None = None
) -> list[str]:
    """The full names of the ``nn.Linear`` modules ``targets`` (groups or module names) select, never those of
    ``heads`` (trained in full; the family's heads when None).

    Raises:
        ValueError: for a target that selects no linear layer, naming the groups.
    """
    groups = family.module_groups()
    heads = tuple(family.head_modules() if heads is None else heads)
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    selected: list[str] = []
    for target in targets or tuple(groups):
        if target in groups:
            prefixes = tuple(f"{prefix}." for prefix in groups[target])
            found = [name for name in linear if name.startswith(prefixes)]
        else:
            found = [name for name in linear if name == target or name.endswith(f".{target}")]
        skipped = heads + tuple(family.untrained_modules())
        found = [name for name in found if not name.startswith(skipped)]  # heads train in full
        if not found:
            raise ConfigError(
                f"--lora_target {target!r} selects no linear layer of the {family.name} model; name a group "
                f"({', '.join(groups)}) or a linear module (e.g. {linear[0] if linear else 'none'})"
            )
        selected.extend(name for name in found if name not in selected)
    return selected


def group_of(family: ModelFamily, module_name: str) -> str | None:
    """The group a module belongs to, if any."""
    for group, prefixes in family.module_groups().items():
        if module_name.startswith(tuple(f"{prefix}." for prefix in prefixes)):
            return group
    return None


def apply_lora(
    family: ModelFamily,
    model: nn.Module,
    settings: LoraSettings,
    frozen_groups: Sequence[str] = (),
    heads: Sequence[str] | None = None,
) -> Any:
    """``model`` with LoRA adapters (a ``peft.PeftModel``): only the adapters and the heads train.

    Args:
        heads: The modules trained in full and saved beside the adapters: the family's heads when None (the
            matching objective names its own, ``vlfit.training.itm_objective.trained_heads``).

    Raises:
        ValueError: for a target in a tower ``--freeze`` froze, or a target that selects nothing.
    """
    require_extra("lora", "--lora_r (LoRA adapters)")
    from peft import LoraConfig, get_peft_model

    heads = list(family.head_modules() if heads is None else heads)
    names = target_modules(family, model, settings.targets, heads)
    frozen = sorted({group for name in names if (group := group_of(family, name)) in frozen_groups})
    if frozen:
        raise ConfigError(
            f"--lora_target puts adapters on the {' and '.join(frozen)} tower, which --freeze (or "
            f"--freeze_{frozen[0]}_model) freezes; drop one of the two"
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha if settings.alpha is not None else 2 * settings.r,
        lora_dropout=settings.dropout,
        target_modules=names,
        modules_to_save=heads,
    )
    return get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, all)`` parameters, as ``peft`` counts them for a ``PeftModel``."""
    counter = getattr(model, "get_nb_trainable_parameters", None)
    if counter is not None:
        return counter()
    return sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters())


def load_merged(base: nn.Module, adapters: str) -> nn.Module:
    """``base`` with the adapters of the folder ``adapters`` merged into its weights (a plain model)."""
    require_extra("lora", "a folder of LoRA adapters")
    from peft import PeftConfig, PeftModel

    from vlfit.models.itm import ITM_HEAD, with_itm_head

    if ITM_HEAD in (PeftConfig.from_pretrained(adapters).modules_to_save or ()):
        base = with_itm_head(base)  # type: ignore[arg-type]  # trained beside adapters on a base without one
    return PeftModel.from_pretrained(base, adapters).merge_and_unload()
