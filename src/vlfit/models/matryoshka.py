"""Matryoshka embeddings (Kusupati et al., 2022, "Matryoshka Representation Learning"): the contrastive loss taken at
each of several prefixes of the embedding as well as at its full size, so that the first d dimensions, normalised
again, are a good embedding on their own (jina-clip-v2 keeps over 99% of its retrieval quality at a quarter of its
dimensions).

``MatryoshkaLoss`` wraps a family: its loss of a batch is the weighted mean of the family's own loss over the batch's
full embeddings (weight 1) and over them cut to each size (``prefix_embeddings``, each weighted ``prefix_weight``),
with the same logit scale (and bias), the same negatives, hard negatives and same-image handling, so gradient caching
and every objective take it unchanged. ``vlfit train --matryoshka_dims 32,64,128`` trains with it, and the run
records the sizes in its ``input_spec.json`` (``matryoshka_dims``), where every door that cuts embeddings
(``--embedding_dim``) reads them.

The paper weighs every size alike. Trained from random weights on the demo's data that cost recall at every size: the
plain mean's model was worse at 16 dimensions than a plain run cut to 16 (clip-tiny, 300 steps: 0.193 against 0.213
text->image recall@1, and 0.170 against 0.303 at the full 64), and it scored worse than the plain run even on the
Matryoshka objective it was trained on, so the prefix terms held back the optimisation itself. Prefix weights of 0.5,
0.25 and 0.1 gave 0.247 / 0.253, 0.290 / 0.287 and 0.350 / 0.317 (full / 16): ``DEFAULT_PREFIX_WEIGHT`` is 0.1, better
than the plain run at both sizes there; the demo's BridgeTower run at 0.1 gained at 1/8 (0.633 against 0.570) and paid
at the full size (0.630 against 0.760), where the plain mean gave 0.357 and 0.353 (docs/results.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vlfit.errors import ConfigError
from vlfit.models.family import LOCAL_LOSS, LossEmbeddings, LossScope, ModelFamily

DEFAULT_PREFIX_WEIGHT = (
    0.1  # each prefix size's loss against the full size's 1 (``vlfit train --matryoshka_prefix_weight``)
)
EMBEDDING_ROW = "text"  # every family's loss rows hold the captions' embeddings under this key


def embedding_size(embeddings: LossEmbeddings) -> int:
    """The full size of the embeddings a loss is computed from."""
    return int(embeddings.rows[EMBEDDING_ROW].shape[-1])


def prefix_embeddings(embeddings: LossEmbeddings, size: int) -> LossEmbeddings:
    """``embeddings`` with every embedding row (floating point, the full size last: captions, images, BridgeTower's
    cross-modal ones, hard negatives' ``[n, k, d]``) cut to its first ``size`` dimensions and L2-normalised again;
    the other rows (validity masks, image keys) and the shared scalars as they are."""
    full = embedding_size(embeddings)
    rows = {
        key: torch.nn.functional.normalize(value[..., :size], dim=-1)
        if value.is_floating_point() and value.shape[-1] == full
        else value
        for key, value in embeddings.rows.items()
    }
    return LossEmbeddings(rows, embeddings.shared)


def check_prefix_sizes(sizes: Sequence[int], full: int) -> None:
    """Refuse sizes not below the model's embedding size ``full``, in one line naming the flag.

    Raises:
        ConfigError: naming ``--matryoshka_dims``, the size and the model's.
    """
    over = [size for size in sizes if size >= full]
    if over:
        raise ConfigError(
            f"--matryoshka_dims {','.join(map(str, sizes))}: {over[0]} is not below the model's embedding size "
            f"{full}; give sizes under {full} (the full size is always trained)"
        )


class MatryoshkaLoss:
    """``family`` with its contrastive loss taken at the full size and at each of ``sizes``, a weighted mean;
    everything else is the family's own.

    Args:
        family: The model's family.
        sizes: Prefix sizes, each below the full embedding size (``check_prefix_sizes``).
        prefix_weight: Each prefix size's weight against the full size's 1 (1.0: the plain mean).
    """

    def __init__(self, family: ModelFamily, sizes: Sequence[int], prefix_weight: float = DEFAULT_PREFIX_WEIGHT) -> None:
        self.family = family
        self.sizes = tuple(sorted(set(sizes)))
        self.prefix_weight = prefix_weight

    def __getattr__(self, name: str) -> Any:
        return getattr(self.family, name)

    def contrastive_loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], scope: LossScope = LOCAL_LOSS
    ) -> torch.Tensor:
        embeddings = self.family.loss_embeddings(model, inputs)
        return self.loss_from_embeddings(embeddings, scope)

    def loss_from_embeddings(self, embeddings: LossEmbeddings, scope: LossScope = LOCAL_LOSS) -> torch.Tensor:
        full = embedding_size(embeddings)
        check_prefix_sizes(self.sizes, full)
        prefixes = [self.family.loss_from_embeddings(prefix_embeddings(embeddings, size), scope) for size in self.sizes]
        total = self.family.loss_from_embeddings(embeddings, scope) + self.prefix_weight * torch.stack(prefixes).sum()
        return total / (1 + self.prefix_weight * len(self.sizes))


def with_matryoshka(
    family: ModelFamily, sizes: Sequence[int], prefix_weight: float = DEFAULT_PREFIX_WEIGHT
) -> ModelFamily:
    """``family`` trained at ``sizes`` too (``MatryoshkaLoss``), or ``family`` itself without sizes."""
    return MatryoshkaLoss(family, sizes, prefix_weight) if sizes else family  # type: ignore[return-value]
