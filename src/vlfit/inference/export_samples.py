"""The decoded samples an export measures parity and calibrates INT8 on (``vlfit export``, the inference
benchmark): every sample of a source through the fast CPU pipeline, held at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from vlfit.data.batch import BadSample
from vlfit.data.image_inputs import concat_image_batches, encoder_inputs
from vlfit.data.pipeline import host_batches
from vlfit.data.sources.base import ImageTextSource
from vlfit.errors import DataError
from vlfit.models.family import IMAGE_KEYS, InputSpec


@dataclass
class Samples:
    """Decoded samples held at once (export's parity and calibration samples).

    Attributes:
        pixels: uint8 ``[N, 3, H, W]``.
        captions: The N captions.
        ids: The N sample ids.
        bad_samples: Samples left out.
        image_keys: int64 ``[N]``, which image each sample shows (``Record.image_key``: samples of one image share
            it, as evaluation groups them); ``None``: each sample its own image.
        patches: A NaFlex model's ``pixel_attention_mask`` ``[N, P]`` and ``spatial_shapes`` ``[N, 2]`` (``pixels``
            are then uint8 patches ``[N, P, p * p * 3]``); ``None`` for square images.
    """

    pixels: torch.Tensor
    captions: list[str]
    ids: list[str]
    bad_samples: list[BadSample]
    image_keys: torch.Tensor | None = None
    patches: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def images(self, rows: slice) -> tuple[torch.Tensor, ...]:
        """The image inputs of ``rows`` (``encode_images(*samples.images(rows))``): pixels, and a NaFlex model's
        patch mask and grids, cut to the rows' longest image."""
        if self.patches is None:
            return (self.pixels[rows].contiguous(),)
        mask, shapes = self.patches[0][rows], self.patches[1][rows]
        longest = int(shapes.prod(-1).max())
        return self.pixels[rows, :longest].contiguous(), mask[:, :longest].contiguous(), shapes.contiguous()


def load_samples(
    source: ImageTextSource,
    spec: InputSpec,
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: str | None = None,
) -> Samples:
    """Every sample of ``source`` through the fast CPU pipeline, held at once.

    Args:
        source: The samples.
        spec: The model's input spec.
        batch_size: Samples per batch.
        num_workers: Loader worker processes.
        progress: A progress bar with this label (``None``: none).

    Raises:
        DataError: when no sample is usable.
    """
    captions = source.captions()
    images, ids, texts, bad, keys = [], [], [], [], []
    bar = tqdm(total=len(source), unit="img", desc=progress, leave=False, disable=progress is None)
    for batch in host_batches(source, spec, batch_size=batch_size, num_workers=num_workers):
        bar.update(len(batch) + len(batch.bad_samples))
        bad.extend(batch.bad_samples)
        if len(batch):
            images.append(encoder_inputs(batch.inputs))
            ids.extend(batch.sample_ids)
            texts.extend(str(captions[position]) for position in batch.positions)
            keys.append(batch[IMAGE_KEYS])
    bar.close()
    if not images:
        raise DataError(f"{source.name}: no usable sample ({len(bad)} bad)")
    joined = concat_image_batches(images)  # NaFlex: each batch padded to its own longest image, then to the longest
    patches = (joined["pixel_attention_mask"], joined["spatial_shapes"]) if "spatial_shapes" in joined else None
    return Samples(joined["pixels"], texts, ids, bad, torch.cat(keys), patches)
