"""Every image of the bad-input corpus through every pipeline: valid ones decode to the right RGB pixels (EXIF
orientation applied), the others are ``DecodeError``s naming the sample and the reason."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.data.image_factory import psnr
from tests.robustness.bad_corpus import CorpusImage, bad_images, expected_png, valid_images
from vlfit.data.decode import DecodeError
from vlfit.data.device_decode import decode_resize_batch, decode_resize_batch_skipping_bad
from vlfit.data.image_transforms import EncodedImage, FastImageTransform, PassThroughEncoded, ReferenceImageTransform

SIZE = 32
PIPELINES = ("reference", "fast", "device")
# Pipelines resample differently (DCT-domain scaling, float vs uint8 resize); 30 dB is far above what a wrong
# orientation, a wrong colour conversion or a wrong frame gives (checked by the orientation test below).
MIN_PSNR_DB = 30.0
VALID = valid_images()
BAD = bad_images()


def run_pipeline(pipeline: str, data: bytes, sample_id: str) -> np.ndarray:
    """``[3, SIZE, SIZE]`` float pixels in [0, 1] as ``pipeline`` makes them from ``data``."""
    if pipeline == "fast":
        return FastImageTransform(SIZE)(data, sample_id).float().numpy() / 255
    if pipeline == "reference":  # mean 0, std 1: the output is the resized image itself
        return ReferenceImageTransform(SIZE, (0.0,) * 3, (1.0,) * 3)(data, sample_id).numpy()
    # Device decode, run on the CPU: the worker's header check, then the batch decode.
    encoded = PassThroughEncoded()(data, sample_id)
    return decode_resize_batch([encoded], SIZE, "cpu")[0].float().numpy() / 255


def _ids(images: list[CorpusImage]) -> list[str]:
    return [image.name for image in images]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("image", VALID, ids=_ids(VALID))
def test_valid_image_decodes_to_the_expected_rgb(pipeline: str, image: CorpusImage) -> None:
    out = run_pipeline(pipeline, image.data, image.name)
    assert out.shape == (3, SIZE, SIZE)
    reference = run_pipeline(pipeline, expected_png(image), "expected")
    assert psnr(out, reference) >= MIN_PSNR_DB


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("name", ["jpeg_exif_rotated_6", "jpeg_exif_rotated_8"])
def test_exif_orientation_is_applied(pipeline: str, name: str) -> None:
    image = next(i for i in VALID if i.name == name)
    out = run_pipeline(pipeline, image.data, name)
    oriented = run_pipeline(pipeline, expected_png(image), "oriented")
    # The same pixels without the rotation: what a decoder ignoring EXIF would give.
    stored = CorpusImage(
        "stored", b"", expected=np.ascontiguousarray(np.rot90(image.expected, k=1 if "6" in name else -1))
    )
    unrotated = run_pipeline(pipeline, expected_png(stored), "stored")
    assert psnr(out, oriented) >= MIN_PSNR_DB
    assert psnr(out, unrotated) < MIN_PSNR_DB - 10


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("name", ["jpeg_grayscale", "png_16bit"])
def test_single_channel_images_come_out_as_three_equal_channels(pipeline: str, name: str) -> None:
    image = next(i for i in VALID if i.name == name)
    out = run_pipeline(pipeline, image.data, name)
    np.testing.assert_allclose(out[0], out[1], atol=1 / 255)
    np.testing.assert_allclose(out[0], out[2], atol=1 / 255)
    assert out.std() > 0.02  # real content, not a flat (e.g. clipped-to-white) image


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("image", BAD, ids=_ids(BAD))
def test_bad_image_is_a_decode_error_naming_the_sample(pipeline: str, image: CorpusImage) -> None:
    sample_id = f"row-{image.name}"
    with pytest.raises(DecodeError) as caught:
        run_pipeline(pipeline, image.data, sample_id)
    message = str(caught.value)
    assert message.startswith(f"sample {sample_id}: ")
    assert image.bad_reason is not None and re.search(image.bad_reason, message), message


def test_device_decode_worker_header_check_catches_all_but_scan_corruption() -> None:
    """Only corruption after the header reaches device decode; the rest is found while it can be replaced."""
    caught_in_worker = []
    for image in BAD:
        try:
            PassThroughEncoded()(image.data, image.name)
        except DecodeError:
            caught_in_worker.append(image.name)
    assert set(caught_in_worker) == {image.name for image in BAD} - {"jpeg_truncated"}
    for image in VALID:
        assert PassThroughEncoded()(image.data, image.name).data == image.data


def test_device_decode_refuses_every_bad_image_itself() -> None:
    """Without the worker's check (e.g. EncodedImage built elsewhere) the batch decoder still refuses them all,
    naming each, and never hands a declared bomb to decode_jpeg."""
    mixed = [EncodedImage(image.data, image.name) for image in (*VALID[:3], *BAD, *VALID[3:5])]
    pixels, failed = decode_resize_batch_skipping_bad(mixed, SIZE, "cpu")
    assert [name for _, name, _ in failed] == _ids(BAD)
    assert [i for i, _, _ in failed] == list(range(3, 3 + len(BAD)))
    for (_, _, reason), image in zip(failed, BAD, strict=True):
        assert image.bad_reason is not None and re.search(image.bad_reason, reason), reason
    good = [*VALID[:3], *VALID[3:5]]
    assert pixels.shape == (len(good), 3, SIZE, SIZE) and pixels.dtype == torch.uint8
    for row, image in zip(pixels, good, strict=True):
        expected = decode_resize_batch([EncodedImage(image.data, image.name)], SIZE, "cpu")[0]
        assert torch.equal(row, expected)
    with pytest.raises(DecodeError, match="sample jpeg_truncated: "):
        decode_resize_batch(mixed, SIZE, "cpu")
