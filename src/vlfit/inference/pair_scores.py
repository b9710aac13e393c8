"""Each image-text pair of a split embedded by a model: for ``vlfit filter`` the cosine of the pair's two embeddings
(DataComp's CLIP score), for ``vlfit mine`` every caption against every image.

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
class PairEmbeddings:
    """The embeddings of one split's pairs, each row's image and caption (the image embedded once per row).

    Attributes:
        positions: The rows of the source that were embedded, in source order (int64).
        images: Each embedded row's image embedding ``[rows, dim]``, float32, L2-normalised.
        texts: Each embedded row's caption embedding ``[rows, dim]``, float32, L2-normalised.
        bad_samples: The rows left out, each with its id and reason.
    """

    positions: np.ndarray
    images: torch.Tensor
    texts: torch.Tensor
    bad_samples: list[BadSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)

    def scores(self) -> np.ndarray:
        """Each row's cosine of its image and caption, float32 in ``[-1, 1]`` (DataComp's CLIP score)."""
        return (self.images * self.texts).sum(dim=-1).numpy().astype(np.float32)


def embed_pairs(
    runtime: ModelRuntime,
    source: ImageTextSource,
    *,
    batch_size: int = 64,
    num_workers: int = 0,
    bad_sample_policy: str = "skip",
) -> PairEmbeddings:
    """Embed each row's image and caption, ``batch_size`` rows to a forward of each tower.

    Args:
        runtime: The model (a checkpoint or an export, ``ModelRuntime.open``).
        source: The split.
        batch_size: Rows per forward.
        num_workers: Loader workers decoding and resizing the images.
        bad_sample_policy: ``skip`` (leave bad samples out and list them) or ``raise``.

    Raises:
        BadSampleError: under ``raise``, naming the first bad sample and the reason.
    """
    encoder = runtime.encoder
    captions = source.captions()
    positions: list[int] = []
    images: list[torch.Tensor] = []
    texts: list[torch.Tensor] = []
    bad: list[BadSample] = []
    with torch.inference_mode():
        for batch in host_batches(source, encoder.spec, batch_size=batch_size, num_workers=num_workers):
            if batch.bad_samples and bad_sample_policy == "raise":
                first = batch.bad_samples[0]
                raise BadSampleError.for_sample(first.id, first.reason, RAISE_HINT)
            bad.extend(batch.bad_samples)
            if not len(batch):
                continue
            words = [clean_caption(captions[p], i) for p, i in zip(batch.positions, batch.sample_ids, strict=True)]
            images.append(encoder.encode_images(**encoder_inputs(batch.inputs)).float())
            texts.append(encoder.encode_texts(words).float())
            positions.extend(batch.positions)
    return PairEmbeddings(
        np.asarray(positions, dtype=np.int64),
        torch.cat(images) if images else torch.zeros(0, 0),
        torch.cat(texts) if texts else torch.zeros(0, 0),
        bad,
    )
