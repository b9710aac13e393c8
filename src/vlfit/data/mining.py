"""Hard negatives mined from a split's own captions, positive-aware (NV-Retriever's "TopK-PercPos"): for each row,
the captions of other images its image scores highest against, leaving out any that scores above
``max_negative_ratio`` times the row's own pair (the image against its own caption; or above the pair itself, where
its score is negative), which are often captions that fit the image but were written for another (unlabelled
positives).

A candidate's score is the image's cosine with the candidate caption: the score the contrastive loss gives the image
and its hard negatives (``--hard_negative_column``), so "hardest" is what training will find hardest. Captions are
candidates by their text: a text that any caption of the row's own image has is never a negative of it, and a text
several images share is one candidate. The search is a plain matrix product over the split's unique captions, in
chunks of rows (``chunk_elements`` scores at a time: tens of MB), exact and fine for splits up to about 10^5 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlfit.data.image_groups import group_images
from vlfit.errors import ConfigError

DEFAULT_NUM_NEGATIVES = 4
DEFAULT_MAX_NEGATIVE_RATIO = 0.95  # NV-Retriever's TopK-PercPos margin
DEFAULT_NEGATIVE_COLUMN = "mined_negatives"


@dataclass(frozen=True)
class MiningRule:
    """How many negatives per caption, and the positive-aware cut.

    Raises:
        ConfigError: for fewer than one negative, or a ratio outside (0, 1], naming the flag.
    """

    num_negatives: int = DEFAULT_NUM_NEGATIVES
    max_negative_ratio: float = DEFAULT_MAX_NEGATIVE_RATIO

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise ConfigError(f"--num_negatives must be at least 1, not {self.num_negatives}")
        if not 0.0 < self.max_negative_ratio <= 1.0:
            raise ConfigError(
                f"--max_negative_ratio must be in (0, 1] (e.g. 0.95: candidates above 95% of the positive's score "
                f"are dropped), not {self.max_negative_ratio}"
            )


@dataclass(frozen=True)
class MinedNegatives:
    """Each row's negatives, hardest first.

    Attributes:
        captions: Per row, its negative captions (up to ``num_negatives``; fewer when the split has fewer
            candidates below the cut).
        scores: Per row, each negative's cosine with the row's image.
        positives: Each row's own score (its image against its caption).
        dropped: Per row, how many candidates the positive-aware cut left out.
    """

    captions: list[list[str]]
    scores: list[list[float]]
    positives: np.ndarray
    dropped: np.ndarray


def mine_negatives(
    images: torch.Tensor,
    texts: torch.Tensor,
    captions: Sequence[str],
    image_keys: torch.Tensor | None,
    rule: MiningRule,
    *,
    chunk_elements: int = 1 << 24,
) -> MinedNegatives:
    """The hardest negative captions of each row, from other images, positive-aware.

    Args:
        images: Each row's image embedding ``[rows, dim]``, L2-normalised (``vlfit.inference.pair_scores``).
        texts: Each row's caption embedding ``[rows, dim]``, L2-normalised.
        captions: Each row's caption.
        image_keys: Which image each row shows ``[rows]`` (``ImageTextSource.image_keys``), or ``None``: each row
            its own image. Rows of one image are scored with its first row's embedding, as evaluation scores them.
        rule: How many, and the cut.
        chunk_elements: Scores computed at once (rows of a chunk times unique captions).
    """
    rows = len(captions)
    if not rows:
        return MinedNegatives([], [], np.zeros(0, np.float32), np.zeros(0, np.int64))
    first, image_of_row = group_images(image_keys, rows)
    unique, text_of_row = np.unique(np.asarray(captions, dtype=object).astype(str), return_inverse=True)
    text_of_row = torch.from_numpy(text_of_row.reshape(-1).astype(np.int64))
    first_row_of_text = torch.full((len(unique),), rows, dtype=torch.long).scatter_reduce(
        0, text_of_row, torch.arange(rows), reduce="amin"
    )
    candidates = texts.float()[first_row_of_text]  # [texts, dim]: equal captions embed equally
    image_rows = images.float()[first[image_of_row]]  # [rows, dim]: each row's image's embedding
    positives = (image_rows * texts.float()).sum(dim=-1)
    own_texts = [[] for _ in range(len(first))]  # per image, the texts of its captions
    for row in range(rows):
        own_texts[int(image_of_row[row])].append(int(text_of_row[row]))
    chunk = max(1, chunk_elements // len(unique))
    found: list[list[str]] = []
    found_scores: list[list[float]] = []
    dropped = np.zeros(rows, dtype=np.int64)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        scores = image_rows[start:stop] @ candidates.T  # [chunk, texts]
        local = [(i, t) for i in range(stop - start) for t in own_texts[int(image_of_row[start + i])]]
        own = torch.zeros_like(scores, dtype=torch.bool)
        own[[i for i, _ in local], [t for _, t in local]] = True
        # A ratio of a negative positive would lie above it: the cut is never above the positive itself.
        limit = torch.minimum(rule.max_negative_ratio * positives[start:stop], positives[start:stop])
        too_close = ~own & (scores > limit[:, None])
        dropped[start:stop] = too_close.sum(dim=1).numpy()
        scores = scores.masked_fill(own | too_close, float("-inf"))
        top, index = scores.topk(min(rule.num_negatives, len(unique)), dim=1)
        for values, texts_found in zip(top.tolist(), index.tolist(), strict=True):
            kept = [(v, t) for v, t in zip(values, texts_found, strict=True) if v != float("-inf")]
            found.append([str(unique[t]) for _, t in kept])
            found_scores.append([v for v, _ in kept])
    return MinedNegatives(found, found_scores, positives.numpy().astype(np.float32), dropped)
