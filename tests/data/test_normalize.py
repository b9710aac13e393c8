"""Tests for vlfit.data.normalize: the one uint8 -> normalized float of square pixels and NaFlex patches, and every
image path calling it (the training device stage, the exported image tower) to the same bits."""

from __future__ import annotations

import pytest
import torch

from vlfit.data.batch import Batch
from vlfit.data.device_stage import DeviceStage
from vlfit.data.naflex import PatchImage, collate_patches, patchify
from vlfit.data.normalize import normalize_uint8
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

MEAN = torch.tensor(OPENAI_CLIP_MEAN)
STD = torch.tensor(OPENAI_CLIP_STD)


def random_uint8(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 3, 1, 1), (4, 3, 16, 16)])
def test_normalize_uint8_matches_formula(shape: tuple[int, ...]) -> None:
    pixels = random_uint8(*shape)
    pixels[0, :, 0, 0] = 0
    pixels[-1, :, -1, -1] = 255
    out = normalize_uint8(pixels, MEAN, STD, torch.float32)
    expected = (pixels.double() / 255 - MEAN.double().view(1, 3, 1, 1)) / STD.double().view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and out.shape == pixels.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_normalize_uint8_gives_contiguous_nchw_from_channels_last() -> None:
    pixels = random_uint8(2, 3, 6, 9, seed=4)
    channels_last = pixels.contiguous(memory_format=torch.channels_last)
    out = normalize_uint8(channels_last, MEAN, STD, torch.float32)
    assert out.is_contiguous()
    assert torch.equal(out, normalize_uint8(pixels, MEAN, STD, torch.float32))


def test_normalize_uint8_output_dtype() -> None:
    pixels = random_uint8(2, 3, 8, 8)
    expected = normalize_uint8(pixels, MEAN, STD, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        out = normalize_uint8(pixels, MEAN, STD, dtype)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


def test_patches_normalize_as_the_square_pixels_they_were_cut_from_and_padding_is_zero() -> None:
    square = random_uint8(3, 32, 48, seed=5)
    batch = collate_patches(
        [PatchImage(patchify(square, 16), 2, 3), PatchImage(patchify(square[:, :16, :16], 16), 1, 1)]
    )
    out = normalize_uint8(batch["pixel_values"], MEAN, STD, mask=batch["pixel_attention_mask"])
    assert torch.equal(out[0], patchify(normalize_uint8(square[None], MEAN, STD)[0], 16))
    assert float(out[1, 1:].abs().sum()) == 0.0 and float(out[1, 0].abs().sum()) > 0


@pytest.mark.parametrize("preset", ["clip-tiny", "siglip2-tiny"])
def test_the_exported_image_tower_normalizes_as_training_does_to_the_bit(preset: str) -> None:
    """The tower ``vlfit export`` traces and the PyTorch backend runs embeds the device stage's own pixels."""
    from vlfit.inference.towers import ImageTower
    from vlfit.models.family import image_inputs
    from vlfit.models.loading import load_model

    bundle = load_model(model_preset=preset, captions=lambda: ["a red circle", "two green squares"] * 10)
    model, spec = bundle.model.eval(), bundle.inputs
    if spec.max_num_patches is None:
        inputs = {"pixel_values": random_uint8(2, 3, spec.image_size, spec.image_size, seed=6)}
    else:
        images = [PatchImage(patchify(random_uint8(3, 16 * r, 16 * c, seed=r), 16), r, c) for r, c in [(2, 3), (4, 4)]]
        inputs = collate_patches(images)
    stage = DeviceStage(spec.image_size, spec.image_mean, spec.image_std)
    rows = len(inputs["pixel_values"])
    staged = stage(
        Batch(dict(inputs), [str(i) for i in range(rows)], list(range(rows))), torch.device("cpu"), train=False
    )
    with torch.no_grad():
        trained = bundle.family.encode_image(model, **image_inputs(staged.inputs))
        tower = ImageTower(bundle.family, model, spec)(*(inputs[name] for name in image_inputs(inputs)))
    assert torch.equal(tower, trained)
