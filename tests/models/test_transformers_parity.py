"""A saved model folder embeds in plain transformers as in vlfit.

Each family's tiny preset is built as ``vlfit train`` builds it (``load_model``: the BPE tokenizer trained on
the captions, the preset's image processor) and saved as every vlfit command saves a model folder
(``LoadedModel.save``: ``save_pretrained`` of the model, then ``save_inputs``, whose ``saved_tokenizer`` is also
what the Trainer of ``vlfit train`` is given to save). The folder is then loaded with transformers alone, called as
the family's model card documents, and compared with vlfit's own embeddings: captions tokenized by the collator and
embedded by ``family.encode_text``, images through the fast pipeline (decode, uint8 crop and resize, normalization
on the device) and ``family.encode_image``.

The images are PNGs at the model's exact input size (64 x 64), so that neither side resizes: what is compared is
the decode, the normalization, the tokenization and the forward. Non-square photos are resized and cropped too: the
saved image processor does what vlfit does (the short side resized, the central square cut, with the same
rounding), for every family, so their embeddings agree as well. (JPEGs much larger than the model's input are
decoded by vlfit's fast pipeline with DCT scaling, a faster approximation of the full decode and resize.)
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModel,
    AutoProcessor,
    AutoTokenizer,
    BridgeTowerForContrastiveLearning,
    CLIPModel,
    MetaClip2Model,
    SiglipModel,
)

import vlfit
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.data.records import Record
from vlfit.data.sources.memory import MemorySource
from vlfit.models.loading import LoadedModel, load_model

TRAINING_CAPTIONS = [
    "two red circles on the left",
    "one blue square at the top",
    "three green crosses near a yellow triangle",
    "a small purple star in the corner",
] * 10
TEXTS = [
    "two red circles",
    "a blue square at the top and three green crosses near a yellow triangle, with a small purple star",
    "unseen words: zebra quartz",
]
MIN_COSINE = 0.999


def png_images(size: int, count: int, shapes: list[tuple[int, int]] | None = None) -> list[bytes]:
    """``count`` PNG files of ``size x size`` pixels (a colour gradient with noise), or of the ``(width, height)``
    of ``shapes`` (with a red block off the centre, where cropping and squashing differ)."""
    rng = np.random.default_rng(0)
    files = []
    for index in range(count):
        width, height = shapes[index] if shapes else (size, size)
        across, down = np.linspace(0, 255, width, dtype=np.float32), np.linspace(0, 255, height, dtype=np.float32)
        base = np.stack(
            [across[None, :].repeat(height, 0), down[:, None].repeat(width, 1), np.full((height, width), 40.0 * index)],
            -1,
        )
        if shapes:
            base[height // 3 : height // 2, width // 5 : width // 2] = (250, 20, 20)
        pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        files.append(buffer.getvalue())
    return files


@dataclass
class Embeddings:
    text: torch.Tensor
    image: torch.Tensor


def vlfit_embeddings(bundle: LoadedModel, images: list[bytes]) -> Embeddings:
    """vlfit's embeddings of ``TEXTS`` and ``images``, through its input pipeline as evaluation runs it."""
    records = [Record(str(i), image, text) for i, (image, text) in enumerate(zip(images, TEXTS, strict=True))]
    pipeline = InputPipeline(bundle.inputs, PipelineOptions(image_pipeline="fast"), torch.device("cpu"))
    loader = pipeline.loader(pipeline.dataset(MemorySource(records, "parity"), train=False), batch_size=8)
    (batch,) = list(pipeline.feed(loader, torch.float32, train=False))
    model = bundle.model.eval()
    with torch.no_grad():
        text = bundle.family.encode_text(model, batch["input_ids"], batch["attention_mask"])
        image = bundle.family.encode_image(model, batch["pixel_values"])
    return Embeddings(text, image)


def pil_images(images: list[bytes]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def plain_siglip(folder: str, images: list[bytes]) -> Embeddings:
    """SigLIP's model card: ``padding="max_length"``, then ``get_text_features(**inputs)``."""
    model = AutoModel.from_pretrained(folder).eval()
    assert isinstance(model, SiglipModel)
    processor = AutoProcessor.from_pretrained(folder)
    text_inputs = processor(text=TEXTS, padding="max_length", return_tensors="pt")
    assert set(text_inputs) == {"input_ids"}  # SigLIP trained without an attention mask, and vlfit too
    image_inputs = processor(images=pil_images(images), return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(**text_inputs).pooler_output
        image = model.get_image_features(**image_inputs).pooler_output
    return Embeddings(text, image)


def plain_clip(folder: str, images: list[bytes], model_class: type = CLIPModel) -> Embeddings:
    """CLIP's model card (and MetaCLIP 2's, with ``MetaClip2Model``): one processor call with ``padding=True``, then
    the two feature methods."""
    model = AutoModel.from_pretrained(folder).eval()
    assert isinstance(model, model_class)
    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(text=TEXTS, images=pil_images(images), padding=True, return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        image = model.get_image_features(pixel_values=inputs["pixel_values"])
    return Embeddings(text.pooler_output, image.pooler_output)


def plain_bridgetower(folder: str, images: list[bytes]) -> Embeddings:
    """BridgeTower's contrastive head: the forward's ``text_embeds`` and ``image_embeds``."""
    model = BridgeTowerForContrastiveLearning.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(images=pil_images(images), text=TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        outputs = model(**inputs)
    return Embeddings(outputs.text_embeds, outputs.image_embeds)


PLAIN: dict[str, tuple[str, Callable[[str, list[bytes]], Embeddings]]] = {
    "bridgetower": ("tiny", plain_bridgetower),
    "clip": ("clip-tiny", plain_clip),
    "metaclip2": ("metaclip2-tiny", partial(plain_clip, model_class=MetaClip2Model)),
    "siglip": ("siglip-tiny", plain_siglip),
}


def assert_same_directions(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    cosines = torch.nn.functional.cosine_similarity(ours, theirs.float(), dim=-1)
    assert cosines.min() >= MIN_COSINE, f"{what}: cosines {cosines.tolist()}"


@pytest.mark.parametrize("family", sorted(PLAIN))
def test_a_saved_folder_embeds_in_plain_transformers_as_in_vlfit(family: str, tmp_path: Path):
    preset, plain = PLAIN[family]
    torch.manual_seed(0)
    bundle = load_model(model_preset=preset, captions=lambda: TRAINING_CAPTIONS)
    assert bundle.family.name == family
    folder = str(tmp_path / "model")
    bundle.save(folder)
    images = png_images(bundle.image_size, len(TEXTS))

    ours = vlfit_embeddings(bundle, images)
    theirs = plain(folder, images)
    assert_same_directions(ours.text, theirs.text, f"{family} text")
    assert_same_directions(ours.image, theirs.image, f"{family} images")

    # vlfit reads the folder back (its collator still gets an attention mask) to the same embeddings.
    reloaded = vlfit_embeddings(load_model(model_name_or_path=folder), images)
    assert_same_directions(reloaded.text, ours.text, f"{family} text, reloaded")
    assert_same_directions(reloaded.image, ours.image, f"{family} images, reloaded")


# 3:2 landscape, a portrait, and 16:9 (longer than BridgeTowerImageProcessor's cap of 1333/800 of the short side).
PHOTO_SHAPES = [(150, 100), (90, 170), (256, 144)]


@pytest.mark.parametrize("family", sorted(PLAIN))
def test_non_square_photos_embed_in_plain_transformers_as_in_vlfit(family: str, tmp_path: Path):
    preset, plain = PLAIN[family]
    torch.manual_seed(0)
    bundle = load_model(model_preset=preset, captions=lambda: TRAINING_CAPTIONS)
    folder = str(tmp_path / "model")
    bundle.save(folder)
    photos = png_images(bundle.image_size, len(TEXTS), PHOTO_SHAPES)
    # Before, SigLIP's processor squashed the photo to the square and BridgeTower's rounded its sides to multiples
    # of 32 (cosines 0.85-0.99), and every family's crop was up to a pixel off vlfit's.
    ours = torch.from_numpy(vlfit.load(folder).encode_images(photos))
    assert_same_directions(ours, plain(folder, photos).image, f"{family} non-square photos")


@pytest.mark.parametrize("family", sorted(PLAIN))
def test_saved_special_token_ids_fit_the_vocabulary_and_the_tokenizer(family: str, tmp_path: Path):
    preset, _ = PLAIN[family]
    bundle = load_model(model_preset=preset, captions=lambda: TRAINING_CAPTIONS)
    folder = str(tmp_path / "model")
    bundle.save(folder)
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        text = AutoConfig.from_pretrained(folder).get_text_config()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    finally:
        transformers_logger.removeHandler(handler)
    ids = {name: getattr(text, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert all(0 <= value < text.vocab_size for value in ids.values()), ids
    assert ids == {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    # transformers <= 5.24 warns about SiglipTextConfig's own defaults (49406 and 49407 in a 32000-token vocabulary)
    # whenever it prints a SigLIP config (huggingface/transformers#47612): never about a saved folder's ids.
    for message in warned:
        if "within the vocabulary" in message:
            assert not any(f"got {value}." in message for value in ids.values()), message
