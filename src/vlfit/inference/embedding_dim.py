"""A chosen embedding size (``--embedding_dim``, ``vlfit.load(embedding_dim=)``): every embedding cut to its first
``d`` dimensions and L2-normalized again.

A Matryoshka run (``--matryoshka_dims``) was trained so that those prefixes are embeddings on their own; its
``input_spec.json`` records the sizes. The encoder (``vlfit.inference.backends.Encoder``) cuts what it returns, the
one place embeddings leave a model, so an index, a query, a server, the API and a push all see the same size, and
its ``identity`` says it: an index built at ``d`` records ``d`` and its queries are embedded at ``d``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vlfit.inference.identity import RefusedModelError

logger = logging.getLogger(__name__)


def trained_sizes(record: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The prefix sizes a run was trained for, from its input settings (``input_spec.json``, or an export manifest's
    copy of it): ``matryoshka_dims``, empty for an ordinary run (which has its full size only)."""
    return tuple(int(size) for size in (record or {}).get("matryoshka_dims") or ())


def checked_size(size: int | None, full: int, trained: Sequence[int], model: str) -> int | None:
    """The size to cut embeddings of ``full`` dimensions to (``None``: none, for ``size`` None or ``full``); a size
    the run was not ``trained`` for is allowed, with one line in the log.

    Raises:
        RefusedModelError: for a size larger than ``full``, naming the range.
    """
    if size is None or size == full:
        return None
    if size > full:
        raise RefusedModelError(
            f"--embedding_dim {size} is more than the {full} dimensions {model} embeds into; give 1 to {full}, or "
            "leave the flag out for all of them"
        )
    if size not in trained:
        shown = ", ".join(str(s) for s in sorted({*trained, full}))
        logger.info("--embedding_dim %d: %s was trained for sizes %s; its first %d dimensions were not trained to "
                    "stand alone (train with --matryoshka_dims to make them)", size, model, shown, size)  # fmt: skip
    return size


def cut(embeddings: torch.Tensor, size: int | None) -> torch.Tensor:
    """``embeddings [N, D]`` as their first ``size`` dimensions, L2-normalized again (``size`` None: as they are)."""
    if size is None:
        return embeddings
    return torch.nn.functional.normalize(embeddings[:, :size], dim=-1)


__all__ = ["checked_size", "cut", "trained_sizes"]
