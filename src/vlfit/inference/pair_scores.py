"""How well each image-text pair of a split agrees, by a model: the cosine of the pair's two embeddings (DataComp's
CLIP score), for ``vlfit filter``.

The images come through the one CPU image path of the model (``host_batches`` over the runtime's input spec, the
loader ``retrieve index`` embeds with), the captions through the runtime's text encoder, so a score is exactly the
cosine ``vlfit.load(run)`` gives the same pair. An image that cannot be read or decoded, or a missing caption, is a
bad sample: left out and listed (``--bad_sample_policy skip``), or the end of the run (``raise``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vlfit.data.bad_samples import RAISE_HINT, BadSampleError, clean_caption
from vlfit.data.batch import BadSample
from vlfit.data.image_inputs import encoder_inputs
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.inference.runtime import ModelRuntime


@dataclass
class PairScores:
    """The scores of one split's pairs.

    Attributes:
        positions: The rows of the source that were scored, in source order (int64).
        scores: Each scored row's cosine, float32, in ``[-1, 1]``.
        bad_samples: The rows left out, each with its id and reason.
    """

    positions: np.ndarray
    scores: np.ndarray
    bad_samples: list[BadSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)


def score_pairs(
    runtime: ModelRuntime,
    source: ImageTextSource,
    *,
    batch_size: int = 64,
    num_workers: int = 0,
    bad_sample_policy: str = "skip",
) -> PairScores:
    """The cosine of each pair's image and caption embeddings, ``batch_size`` pairs to a forward of each tower.

    Args:
        runtime: The model (a checkpoint or an export, ``ModelRuntime.open``).
        source: The split.
        batch_size: Pairs per forward.
        num_workers: Loader workers decoding and resizing the images.
        bad_sample_policy: ``skip`` (leave bad samples out and list them) or ``raise``.

    Raises:
        BadSampleError: under ``raise``, naming the first bad sample and the reason.
    """
    encoder = runtime.encoder
    captions = source.captions()
    positions: list[int] = []
    scores: list[torch.Tensor] = []
    bad: list[BadSample] = []
    with torch.inference_mode():
        for batch in host_batches(source, encoder.spec, batch_size=batch_size, num_workers=num_workers):
            if batch.bad_samples and bad_sample_policy == "raise":
                first = batch.bad_samples[0]
                raise BadSampleError.for_sample(first.id, first.reason, RAISE_HINT)
            bad.extend(batch.bad_samples)
            if not len(batch):
                continue
            texts = [clean_caption(captions[p], i) for p, i in zip(batch.positions, batch.sample_ids, strict=True)]
            images = encoder.encode_images(**encoder_inputs(batch.inputs)).float()
            scores.append((images * encoder.encode_texts(texts).float()).sum(dim=-1))
            positions.extend(batch.positions)
    return PairScores(
        np.asarray(positions, dtype=np.int64),
        torch.cat(scores).numpy().astype(np.float32) if scores else np.zeros(0, np.float32),
        bad,
    )
