"""SetFit's recipe on the image tower: contrastive fine-tuning on pairs of the few labelled images.

SetFit samples pairs of labelled examples, as many same-class (target cosine similarity 1) as other-class (target
0), and fine-tunes the embedding model on the squared error of their cosine similarity. Here every step embeds a
batch of the shots once, two randomly cropped and flipped views of each, and takes the loss over *every* pair of
views in it, positives and negatives weighted equally: the expectation of SetFit's balanced sampling, at one
forward per image instead of two per pair. The two views make a positive pair even with one shot per class.

Only the parameters the image embedding depends on train (the text tower is left as it is); ``WeightSnapshot``
puts them back between runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vlfit.data.image_inputs import ImageBatch, collate_images, concat_image_batches, select_images, split_images
from vlfit.data.naflex import PatchImage, patchify
from vlfit.errors import ConfigError
from vlfit.models.trainable import temporarily_trainable

# Random crops keep this share of the image area, at most and at least.
CROP_AREA = (0.5, 1.0)


@dataclass
class SetFitSettings:
    """Attributes:
    steps: Optimizer steps.
    learning_rate: AdamW's, constant (SetFit's default body learning rate).
    batch_size: Shots per step (each seen as two views when augmenting).
    augment: Random crops and flips; without them each shot is one view.
    """

    steps: int = 30
    learning_rate: float = 2e-5
    batch_size: int = 32
    augment: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--setfit_{name} must be at least 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ConfigError(f"--setfit_learning_rate must be positive, got {self.learning_rate}")


def image_parameters(image_tower: nn.Module, probe: ImageBatch) -> dict[str, nn.Parameter]:
    """The parameters the image embedding of ``probe`` (a batch of one image) depends on, by name."""
    parameters = dict(image_tower.named_parameters())
    for p in parameters.values():
        p.grad = None
    with temporarily_trainable(parameters.values()), torch.enable_grad():
        image_tower(**probe).sum().backward()
    used = {name: p for name, p in parameters.items() if p.grad is not None}
    for p in parameters.values():
        p.grad = None
    return used


class WeightSnapshot:
    """A copy of some parameters, to put back after a run changed them."""

    def __init__(self, parameters: dict[str, nn.Parameter]) -> None:
        self.parameters = parameters
        self.saved = {name: p.detach().clone() for name, p in parameters.items()}

    def restore(self) -> None:
        with torch.no_grad():
            for name, p in self.parameters.items():
                p.copy_(self.saved[name])


def random_views(images: ImageBatch, generator: torch.Generator) -> ImageBatch:
    """A random view (``random_view``) of each image of a batch: a NaFlex model's at its own grid, whose patches
    are put together into the image, viewed and cut again."""
    if "spatial_shapes" not in images:
        return {"pixels": torch.stack([random_view(image, generator) for image in images["pixels"]])}
    views = []
    for image in split_images(images):
        assert isinstance(image, PatchImage)
        patch = math.isqrt(image.patches.shape[1] // 3)
        pixels = image.patches.view(image.rows, image.columns, patch, patch, 3).permute(4, 0, 2, 1, 3)
        view = random_view(pixels.reshape(3, image.rows * patch, image.columns * patch), generator)
        views.append(PatchImage(patchify(view, patch), image.rows, image.columns))
    return collate_images(views)


def random_view(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random crop (``CROP_AREA`` of the area, aspect ratio 3:4 to 4:3) of a uint8 image ``[3, H, W]``, resized
    back to ``H x W``, flipped left-right with probability 1/2."""
    _, height, width = image.shape
    area = float(torch.empty(1).uniform_(*CROP_AREA, generator=generator)) * height * width
    ratio = float(torch.exp(torch.empty(1).uniform_(np.log(3 / 4), np.log(4 / 3), generator=generator)))
    h = min(height, max(1, round((area / ratio) ** 0.5)))
    w = min(width, max(1, round((area * ratio) ** 0.5)))
    top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
    left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
    crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
    resized = nn.functional.interpolate(crop, size=(height, width), mode="bilinear", antialias=True)
    view = resized.round().clamp(0, 255).to(torch.uint8)[0]
    if bool(torch.rand(1, generator=generator) < 0.5):
        view = view.flip(-1)
    return view


def pair_loss(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error of every pair's cosine similarity against 1 (same class) or 0 (other class), the
    positive and the negative pairs weighted equally; an embedding is not paired with itself."""
    cosine = embeddings @ embeddings.T
    same = labels[:, None] == labels[None, :]
    other = torch.eye(len(labels), dtype=torch.bool, device=labels.device).logical_not()
    positives, negatives = cosine[same & other], cosine[~same]
    terms = [(positives - 1).pow(2).mean()] if positives.numel() else []
    if negatives.numel():
        terms.append(negatives.pow(2).mean())
    return torch.stack(terms).mean()


def tune_image_tower(
    image_tower: nn.Module,
    parameters: dict[str, nn.Parameter],
    images: ImageBatch,
    labels: np.ndarray,
    settings: SetFitSettings,
    seed: int,
) -> list[float]:
    """Fine-tune ``parameters`` of ``image_tower`` in place on the shots (their batch ``images``, class ``labels``).

    Returns:
        The loss of every step.
    """
    generator = torch.Generator().manual_seed(seed)
    labels_t = torch.as_tensor(labels, dtype=torch.long)
    optimizer = torch.optim.AdamW(parameters.values(), lr=settings.learning_rate, weight_decay=0.0)
    count = len(images["pixels"])
    order = torch.randperm(count, generator=generator)
    cursor = 0
    losses = []
    image_tower.train()
    try:
        with temporarily_trainable(parameters.values()):
            for _ in range(settings.steps):
                if cursor + settings.batch_size > len(order) and cursor:
                    order, cursor = torch.randperm(count, generator=generator), 0
                batch = order[cursor : cursor + settings.batch_size]
                cursor += len(batch)
                shots, batch_labels = select_images(images, batch), labels_t[batch]
                if settings.augment:
                    shots = concat_image_batches([random_views(shots, generator), random_views(shots, generator)])
                    batch_labels = torch.cat([batch_labels, batch_labels])
                with torch.enable_grad():
                    loss = pair_loss(image_tower(**shots), batch_labels)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                nn.utils.clip_grad_norm_(parameters.values(), 1.0)
                optimizer.step()
                losses.append(float(loss.detach()))
    finally:
        image_tower.eval()
        for p in parameters.values():
            p.grad = None
    return losses
