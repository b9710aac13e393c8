"""NaFlex in the fast pipeline: the grid, the header read, the scaled decode, the patches, the padded batch."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Siglip2ImageProcessor

from tests.data.image_factory import cmyk_jpeg_bytes, exif_jpeg_bytes, jpeg_bytes, png_rgb_bytes, textured_array
from vlfit.data import naflex
from vlfit.data.decode import decode_pil
from vlfit.data.naflex import (
    NaflexTransform,
    PatchImage,
    collate_patches,
    decode_covering,
    image_header,
    patch_grid,
)
from vlfit.data.normalize import normalize_uint8
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.errors import DataError
from vlfit.models.family import InputSpec

MEAN = STD = torch.tensor([0.5, 0.5, 0.5])


def processor_patches(image: Image.Image, patch_size: int, budget: int) -> tuple[torch.Tensor, list[int]]:
    processor = Siglip2ImageProcessor(patch_size=patch_size, max_num_patches=budget, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3)  # fmt: skip
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"][0], out["spatial_shapes"][0].tolist()


@pytest.mark.parametrize(("width", "height"), [(640, 480), (90, 1000), (1000, 90), (7, 5), (333, 222), (512, 512)])
@pytest.mark.parametrize("budget", [16, 256])
def test_full_size_pixels_become_the_processors_patches_exactly(width, height, budget):
    pixels = textured_array(width, height, seed=width)
    ours = NaflexTransform(16, budget).from_pixels(pixels)
    theirs, shape = processor_patches(Image.fromarray(pixels), 16, budget)
    assert [ours.rows, ours.columns] == shape
    count = ours.rows * ours.columns
    normalized = normalize_uint8(ours.patches[None], MEAN, STD, mask=torch.ones(1, count, dtype=torch.int32))[0]
    assert torch.allclose(normalized, theirs[:count], atol=1e-6)  # the same uint8 resize, then the same arithmetic


def test_the_grid_keeps_the_aspect_ratio_within_the_budget():
    for height, width in [(480, 640), (1000, 90), (37, 23), (4000, 3000)]:
        grid_height, grid_width = patch_grid(height, width, 16, 256)
        assert grid_height % 16 == grid_width % 16 == 0
        assert (grid_height // 16) * (grid_width // 16) <= 256
        assert (grid_height > grid_width) == (height > width) or abs(grid_height - grid_width) <= 16


def test_the_size_comes_from_the_header_with_exif_orientation_applied():
    assert image_header(jpeg_bytes(300, 200))[:2] == (200, 300)
    assert image_header(exif_jpeg_bytes(300, 200, orientation=6)) == (300, 200, 6)
    assert image_header(png_rgb_bytes(123, 45))[:2] == (45, 123)
    with pytest.raises(DataError, match="sample x"):
        image_header(b"not an image", "x")


def test_a_large_jpeg_is_decoded_at_the_smallest_scale_covering_twice_its_grid():
    data = jpeg_bytes(2400, 1600)
    grid_height, grid_width = patch_grid(1600, 2400, 16, 16)  # 48 x 80
    pixels = decode_covering(data, 2 * grid_height, 2 * grid_width)
    assert pixels.shape == (200, 300, 3)  # 1/8 of full size: the smallest scale with both sides >= twice the grid
    # CMYK goes through Pillow's draft: scaled too, and RGB.
    pixels = decode_covering(cmyk_jpeg_bytes(2400, 1600), 2 * grid_height, 2 * grid_width)
    assert pixels.shape == (200, 300, 3)


def test_a_rotated_jpeg_is_decoded_scaled_and_turned():
    data = exif_jpeg_bytes(1600, 800, orientation=6)  # shown 800 wide, 1600 tall
    image = NaflexTransform(16, 16)(data, "rotated")
    assert image.rows > image.columns
    assert image.patches.shape == (image.rows * image.columns, 16 * 16 * 3)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_a_scaled_decode_is_resampled_where_a_full_decode_lies(orientation):
    """577 rows are 72 DCT blocks and one row: the last row of a scaled decode stands mostly for padding, first
    after an EXIF turn or flip. The patches are those of the full decode (mean difference 2.8 when the padding was
    resampled too)."""
    data = jpeg_bytes(770, 577, quality=90, subsampling=2, seed=1, orientation=orientation)
    transform = NaflexTransform(16, 16)
    full = transform.from_pixels(np.array(decode_pil(data)))
    assert float((transform(data).patches.float() - full.patches.float()).abs().mean()) < 0.5  # 0.21 measured


def test_a_batch_is_padded_to_its_longest_image_with_the_mask_and_grids():
    images = [PatchImage(torch.full((rows * columns, 12), 7, dtype=torch.uint8), rows, columns)
              for rows, columns in [(2, 3), (1, 1), (4, 2)]]  # fmt: skip
    batch = collate_patches(images)
    assert batch["pixel_values"].shape == (3, 8, 12)
    assert batch["pixel_attention_mask"].tolist()[1] == [1, 0, 0, 0, 0, 0, 0, 0]
    assert batch["spatial_shapes"].tolist() == [[2, 3], [1, 1], [4, 2]]
    assert int(batch["pixel_values"][1, 1:].sum()) == 0
    normalized = normalize_uint8(batch["pixel_values"], MEAN, STD, mask=batch["pixel_attention_mask"])
    assert float(normalized[1, 1:].abs().sum()) == 0.0  # padding rows are zeros, as the processor pads them
    assert normalized[0, 0, 0] == pytest.approx(7 / 127.5 - 1)


def naflex_spec() -> InputSpec:
    return InputSpec(64, (0.5,) * 3, (0.5,) * 3, tokenizer=None, max_num_patches=16, patch_size=16)


@pytest.mark.parametrize("flag", ["horizontal_flip", "random_resized_crop"])
def test_pipeline_options_naflex_images_cannot_take_are_refused_in_one_line(flag):
    with pytest.raises(DataError, match=f"--{flag}: a NaFlex model"):
        InputPipeline(naflex_spec(), PipelineOptions(**{flag: True}), torch.device("cpu"))


def test_a_png_is_decoded_whole_and_resized_once():
    data = png_rgb_bytes(200, 100)
    image = NaflexTransform(16, 16)(data)
    full = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    assert torch.equal(image.patches, NaflexTransform(16, 16).from_pixels(full).patches)
    assert naflex.DECODE_MARGIN >= 2
