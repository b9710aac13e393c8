"""``--objective``: what a training run optimizes. ``contrastive`` (the default) is the family's contrastive loss;
``contrastive+itm`` adds BridgeTower's image-text matching loss on mined hard negatives
(``vlfit.models.itm_loss``), ``itm`` trains the matching loss alone.

This module prepares the model for the objective (a matching head where it needs one; heads the objective never
reaches are frozen, as DDP requires), computes the objective's loss for the trainer and keeps its terms for the
training log.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlfit.errors import ConfigError
from vlfit.models.family import LossScope, ModelFamily
from vlfit.models.itm import ITM_HEAD, has_itm_head, with_itm_head
from vlfit.models.itm_loss import contrastive_and_matching_loss
from vlfit.training.arguments import OBJECTIVES

CONTRASTIVE = OBJECTIVES[0]
# What only the contrastive loss trains: frozen under --objective itm (the similarities that mine negatives come
# from them without gradient).
CONTRASTIVE_HEADS = ("itc_text_head", "itc_image_head", "itc_cross_modal_head", "logit_scale")


def uses_itm(objective: str) -> bool:
    """Whether ``objective`` trains the matching head."""
    return objective != CONTRASTIVE


def prepare_model_for_objective(
    model: nn.Module, family: ModelFamily, objective: str, *, train: bool = True
) -> nn.Module:
    """The model ``objective`` trains: with a matching head when it needs one, and the heads it never reaches
    frozen (DDP fails on parameters that get no gradient). A model that has a matching head keeps it (and it is
    saved) whatever the objective.

    Raises:
        ConfigError: one line, for a family without a fused tower.
    """
    if not train:
        return model
    if not uses_itm(objective):
        if has_itm_head(model):
            model.get_submodule(ITM_HEAD).requires_grad_(False)
        return model
    if family.name != "bridgetower":
        raise ConfigError(
            f"--objective {objective}: image-text matching needs BridgeTower's fused tower and matching head, which "
            f"a {family.name} model does not have; use --objective {CONTRASTIVE}"
        )
    model = with_itm_head(model)  # type: ignore[arg-type]
    if objective == "itm":
        for name, parameter in model.named_parameters():
            if name.split(".")[0] in CONTRASTIVE_HEADS:
                parameter.requires_grad_(False)
    return model


def trained_heads(family: ModelFamily, objective: str) -> tuple[str, ...]:
    """The heads ``objective`` trains in full beside LoRA's adapters (and saves with them): the family's contrastive
    heads unless the objective is ``itm`` alone, and the matching head when it trains one."""
    contrastive = () if objective == "itm" else tuple(family.head_modules())
    return contrastive + ((ITM_HEAD,) if uses_itm(objective) else ())


class TrainingObjective:
    """The loss of ``--objective`` for the trainer, and the mean of its terms since the last log.

    Args:
        objective: One of ``OBJECTIVES``.
        seed: The run's seed; with the step it seeds each batch's draw of negatives (the same on every process).
    """

    def __init__(self, objective: str, seed: int = 0) -> None:
        if objective not in OBJECTIVES:
            raise ConfigError(f"unknown --objective {objective!r}; choose one of: {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.seed = seed
        self._sums: dict[str, torch.Tensor] = {}
        self._batches = 0
        self._step = -1
        self._in_step = 0

    @property
    def uses_itm(self) -> bool:
        return uses_itm(self.objective)

    def loss(
        self,
        family: ModelFamily,
        model: nn.Module,
        inputs: Mapping[str, torch.Tensor],
        *,
        step: int,
        scope: LossScope,
    ) -> torch.Tensor:
        """The matching objective's loss of one batch (``step``: the optimizer step it belongs to)."""
        self._in_step = self._in_step + 1 if step == self._step else 0
        self._step = step
        seed = (self.seed * 1_000_003 + step) * 1024 + self._in_step  # micro-batches of one step draw apart
        loss, terms = contrastive_and_matching_loss(
            family,
            model,
            inputs,
            contrastive=self.objective != "itm",
            scope=scope,
            seed=seed,
        )
        for name, value in terms.items():
            self._sums[name] = self._sums[name] + value if name in self._sums else value  # no device sync per batch
        self._batches += 1
        return loss

    def window(self) -> dict[str, float]:
        """Each term's mean over this process's batches since the last call (empty when none ran)."""
        means = {name: float(total) / self._batches for name, total in self._sums.items()} if self._batches else {}
        self._sums, self._batches = {}, 0
        return means
