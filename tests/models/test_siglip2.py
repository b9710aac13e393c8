"""SigLIP 2 (NaFlex): a saved run embeds in plain transformers as in vlfit, photo by photo, whatever its shape.

The ``siglip2-tiny`` preset is built as ``vlfit train`` builds it and saved as every vlfit command saves a model
folder. Plain transformers then loads the folder (``AutoImageProcessor``: the saved ``Siglip2ImageProcessor``, with
the run's token budget; ``AutoModel``: ``Siglip2Model``) and embeds photos opened as its own ``load_image`` opens
them (EXIF orientation applied, RGB). vlfit embeds the same files through its input pipeline (header, grid, DCT-scaled
decode, one uint8 resize, patches; normalization on the device) and through ``vlfit.load``. SigLIP (1) is held to the
same photos through its saved processor.

The photos are the kinds that break resizing code: tall, wide, smaller than one patch row, 4000 x 3000 (decoded at
1/8 by vlfit, in full by transformers), greyscale, CMYK, EXIF-rotated JPEG and PNG, each with noise, so a resampling
difference shows.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer, Siglip2Model
from transformers.image_utils import load_image

import vlfit
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.data.records import Record
from vlfit.data.sources.memory import MemorySource
from vlfit.errors import ConfigError
from vlfit.models.family import image_inputs
from vlfit.models.loading import load_model

CAPTIONS = ["two red circles on the left", "one blue square at the top", "a small purple star"] * 10
MIN_COSINE = 0.999


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A noisy photo-like RGB array: gradients, waves and an off-centre red block."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([255 * x / width, 255 * y / height, 128 + 100 * np.sin(x / 17 + y / 23)], -1)
    base[height // 3 : height // 2, width // 5 : width // 2] = (250, 20, 20)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, fmt: str = "JPEG", mode: str | None = None, orientation: int | None = None) -> bytes:
    image = Image.fromarray(pixels)
    image = image.convert(mode) if mode else image
    options: dict = {"quality": 90} if fmt == "JPEG" else {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


PHOTOS = {
    "tall": lambda: encoded(photo(300, 900, 0)),
    "wide": lambda: encoded(photo(1200, 250, 1)),
    "tiny": lambda: encoded(photo(23, 37, 2)),
    "huge": lambda: encoded(photo(4000, 3000, 3)),
    "greyscale": lambda: encoded(photo(640, 480, 4), mode="L"),
    "cmyk": lambda: encoded(photo(500, 700, 5), mode="CMYK"),
    "exif-rotated": lambda: encoded(photo(800, 500, 6), orientation=6),
    "exif-rotated png": lambda: encoded(photo(333, 222, 7), fmt="PNG", orientation=8),
}


@pytest.fixture(scope="module")
def photo_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("photos")
    files = {}
    for index, (kind, make) in enumerate(PHOTOS.items()):
        files[kind] = folder / f"{index}.img"
        files[kind].write_bytes(make())
    return files


@pytest.fixture(scope="module")
def siglip2_folder(tmp_path_factory) -> str:
    torch.manual_seed(0)
    folder = str(tmp_path_factory.mktemp("siglip2") / "model")
    load_model(model_preset="siglip2-tiny", captions=lambda: CAPTIONS).save(folder)
    return folder


def pipeline_batch(bundle, files: list[Path]):
    records = [Record(str(i), path.read_bytes(), "a photo") for i, path in enumerate(files)]
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(), torch.device("cpu"))
    loader = pipeline.loader(pipeline.dataset(MemorySource(records, "photos"), train=False), batch_size=len(files))
    (batch,) = list(pipeline.feed(loader, torch.float32, train=False))
    return batch


def plain_images(folder: str, files: list[Path]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = AutoModel.from_pretrained(folder).eval()
    assert isinstance(model, Siglip2Model)
    processor = AutoImageProcessor.from_pretrained(folder)
    inputs = processor(images=[load_image(str(path)) for path in files], return_tensors="pt")
    with torch.no_grad():
        return model.get_image_features(**inputs).pooler_output, inputs


def cosines(ours: torch.Tensor, theirs: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(ours.float(), theirs.float(), dim=-1).tolist()


def test_every_photo_embeds_in_plain_transformers_as_in_vlfit_on_the_same_patch_grid(siglip2_folder, photo_files):
    kinds, files = list(photo_files), list(photo_files.values())
    bundle = load_model(model_name_or_path=siglip2_folder)
    batch = pipeline_batch(bundle, files)
    with torch.no_grad():
        ours = bundle.family.encode_image(bundle.model.eval(), **image_inputs(batch.inputs))
    theirs, plain = plain_images(siglip2_folder, files)

    assert torch.equal(batch["spatial_shapes"], plain["spatial_shapes"].long())
    found = dict(zip(kinds, cosines(ours, theirs), strict=True))
    assert min(found.values()) >= MIN_COSINE, found
    # The batch is padded to its own longest image, not to the budget; rows past an image's patches are masked.
    patches = batch["spatial_shapes"].prod(-1)
    assert batch["pixel_values"].shape[1] == int(patches.max()) <= bundle.inputs.max_num_patches
    assert torch.equal(batch["pixel_attention_mask"].sum(-1), patches.to(torch.int32))
    # Tall photos get tall grids, wide ones wide grids; EXIF orientation turns the grid.
    rows, columns = dict(zip(kinds, batch["spatial_shapes"].tolist(), strict=True))["tall"]
    assert rows > columns
    rows, columns = dict(zip(kinds, batch["spatial_shapes"].tolist(), strict=True))["exif-rotated"]
    assert rows > columns  # stored 800 x 500, shown 500 x 800

    # vlfit.load: the same embeddings from paths, bytes and PIL images.
    model = vlfit.load(siglip2_folder)
    from_paths = torch.from_numpy(model.encode_images(files))
    assert min(cosines(from_paths, ours)) >= 0.99999
    from_pil = torch.from_numpy(model.encode_images([load_image(str(path)) for path in files]))
    assert min(cosines(from_pil, theirs)) >= 0.99999  # the same full-size pixels: only the normalization's rounding


def test_captions_embed_in_plain_transformers_as_in_vlfit(siglip2_folder):
    texts = ["two red circles", "unseen words: zebra quartz"]
    tokens = AutoTokenizer.from_pretrained(siglip2_folder)(texts, padding="max_length", return_tensors="pt")
    model = AutoModel.from_pretrained(siglip2_folder).eval()
    with torch.no_grad():
        theirs = model.get_text_features(**tokens).pooler_output
    ours = torch.from_numpy(vlfit.load(siglip2_folder).encode_texts(texts))
    assert min(cosines(ours, theirs)) >= 0.99999


def test_the_run_records_its_token_budget_and_every_door_uses_it(tmp_path, photo_files):
    bundle = load_model(model_preset="siglip2-tiny", captions=lambda: CAPTIONS, max_num_patches=9)
    folder = str(tmp_path / "model")
    bundle.save(folder)
    record = json.loads(Path(folder, "input_spec.json").read_text())
    assert record["max_num_patches"] == 9 and record["resize"] == "patch_budget"
    assert json.loads(Path(folder, "preprocessor_config.json").read_text())["max_num_patches"] == 9
    reloaded = load_model(model_name_or_path=folder)
    assert reloaded.inputs.max_num_patches == 9
    batch = pipeline_batch(reloaded, list(photo_files.values()))
    assert int(batch["spatial_shapes"].prod(-1).max()) <= 9
    assert load_model(model_name_or_path=folder, max_num_patches=4).inputs.max_num_patches == 4


def test_a_token_budget_for_a_model_of_square_images_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="--max_num_patches is for NaFlex models"):
        load_model(model_preset="siglip-tiny", captions=lambda: CAPTIONS, max_num_patches=64)


def test_siglip_1_photos_embed_in_plain_transformers_as_in_vlfit(tmp_path, photo_files):
    """SigLIP (1): the saved processor resizes and crops as vlfit does, on the same photos."""
    torch.manual_seed(0)
    folder = str(tmp_path / "siglip")
    load_model(model_preset="siglip-tiny", captions=lambda: CAPTIONS).save(folder)
    files = list(photo_files.values())
    model = AutoModel.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    with torch.no_grad():
        theirs = model.get_image_features(
            **processor(images=[load_image(str(path)) for path in files], return_tensors="pt")
        ).pooler_output
    ours = torch.from_numpy(vlfit.load(folder).encode_images(files))
    found = dict(zip(photo_files, cosines(ours, theirs), strict=True))
    assert min(found.values()) >= MIN_COSINE, found


def test_a_door_may_ask_for_another_token_budget(siglip2_folder, photo_files):
    files = list(photo_files.values())
    default = vlfit.load(siglip2_folder)
    fewer = vlfit.load(siglip2_folder, max_num_patches=4)
    assert default.runtime.inputs.max_num_patches == 16 and fewer.runtime.inputs.max_num_patches == 4
    batch = fewer.runtime.image_batch(files)
    assert int(batch["spatial_shapes"].prod(-1).max()) <= 4
    coarse, fine = (torch.from_numpy(model.encode_images(files)) for model in (fewer, default))
    assert min(cosines(coarse, fine)) < 0.9999  # other grids, other embeddings
    with pytest.raises(ConfigError, match="`max_num_patches=` is for NaFlex models"):  # the API's wording
        vlfit.load("siglip-tiny", max_num_patches=4).encode_texts(["a"])


def test_square_pixels_are_refused_in_one_line(siglip2_folder):
    bundle = load_model(model_name_or_path=siglip2_folder)
    with pytest.raises(ConfigError, match="NaFlex model takes each image as patches"):
        bundle.family.encode_image(bundle.model, torch.zeros(1, 3, 64, 64))
