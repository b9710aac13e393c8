"""Captions longer than the text tower's positions: its position embeddings stretched the Long-CLIP way.

CLIP's text tower has 77 learned positions (SigLIP's 64), so whatever a caption says past them is cut. Long-CLIP
(Zhang et al., 2024) keeps the first ``KEPT_POSITIONS`` (20) embeddings, which training shaped most, and stretches
the rest by linear interpolation to the new length (4x: 248 positions), then fine-tunes briefly; it reports +20% R@5
on long-caption retrieval and +6% on standard retrieval. vlfit applies the same stretch to any text tower whose
embeddings hold one learned position table (CLIP, MetaCLIP 2, SigLIP, SigLIP 2: for SigLIP it is this method, not one
of its own authors').

``vlfit train --max_seq_length N`` with N above the tower's positions stretches them before training
(``vlfit.models.loading.resolve_model(stretch_text=True)`` asks for it, ``build_model`` does it); the saved model's
config says N positions and its weights hold N rows, so plain transformers loads the run with nothing missing, and
every door reads N from the run's ``input_spec.json``. Other commands keep cutting captions at the model's positions.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

KEPT_POSITIONS = 20  # the first positions Long-CLIP keeps as they are


def text_embeddings(model: nn.Module) -> Any | None:
    """The text tower's embeddings module when it holds one learned position table (``position_embedding`` and
    its ``position_ids``), else None (BridgeTower's RoBERTa and BERT towers have 512 positions and other layouts)."""
    text_model = getattr(model, "text_model", None)
    embeddings = getattr(text_model, "embeddings", None)
    table = getattr(embeddings, "position_embedding", None)
    if isinstance(table, nn.Embedding) and hasattr(embeddings, "position_ids"):
        return embeddings
    return None


def stretched_table(table: torch.Tensor, length: int, kept: int = KEPT_POSITIONS) -> torch.Tensor:
    """``table`` (``[positions, dim]``) stretched to ``length`` rows: its first ``kept`` rows as they are, the rest
    linearly interpolated (their first and last rows kept) to fill the remaining ``length - kept``."""
    positions = table.shape[0]
    kept = min(kept, positions - 1)
    rest = table[kept:].t().unsqueeze(0)  # [1, dim, positions - kept]
    stretched = torch.nn.functional.interpolate(rest.float(), size=length - kept, mode="linear", align_corners=True)
    return torch.cat([table[:kept], stretched.squeeze(0).t().to(table.dtype)])


def stretch_text_positions(model: nn.Module, length: int) -> None:
    """Give ``model``'s text tower ``length`` positions (``stretched_table``), in its weights and its config.

    Raises:
        ValueError: for a model whose text tower has no single position table, or ``length`` not above its positions.
    """
    embeddings = text_embeddings(model)
    if embeddings is None:
        raise ValueError(f"{type(model).__name__}'s text tower has no position table to stretch")
    old = embeddings.position_embedding
    if length <= old.num_embeddings:
        raise ValueError(f"{length} positions are not more than the text tower's {old.num_embeddings}")
    table = nn.Embedding(length, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        table.weight.copy_(stretched_table(old.weight.detach(), length))
    table.weight.requires_grad_(old.weight.requires_grad)
    embeddings.position_embedding = table
    ids = torch.arange(length, device=embeddings.position_ids.device).expand((1, -1))
    embeddings.register_buffer("position_ids", ids, persistent=False)
    for config in {id(c): c for c in _text_configs(model)}.values():
        config.max_position_embeddings = length


def with_text_positions(config: Any, length: int) -> Any:
    """A copy of ``config`` whose text tower has ``length`` positions."""
    config = copy.deepcopy(config)
    getattr(config, "text_config", config).max_position_embeddings = length
    return config


def _text_configs(model: nn.Module) -> list[Any]:
    """Every config object that says how many positions the text tower has (the model's ``text_config``, the text
    tower's own config)."""
    found = [getattr(model.config, "text_config", None), getattr(getattr(model, "text_model", None), "config", None)]
    return [config for config in found if config is not None and hasattr(config, "max_position_embeddings")]
