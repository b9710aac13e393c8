"""A run is embedded the way it was trained through every door: evaluation (``vlfit eval``, and training's own, which
run the same ``evaluate_retrieval``), ``vlfit.load``, ``retrieve index``, the server's query path and its
``/v1/embeddings``, ``vlfit fewshot``, ``vlfit classify``, the re-ranker's image path and the exported ONNX graphs
agree with plain transformers fed as training feeds the model (captions cut at the run's ``--max_seq_length``,
images through the training pipeline's transform), for each family."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.slow

TRAINED_LENGTH = 16  # not the default (128), nor any family's text positions
LONG = ("two blue squares on the left and one green circle at the top of the picture, a red triangle below "
        "them and a yellow square in the right corner beside a purple circle")  # fmt: skip
TEXTS = ["a red circle", "two green squares on the left", LONG]


def _photos(folder) -> list[str]:
    """Photos of odd aspect ratios (tall, wide, square, tiny) as JPEG files."""
    rng = np.random.default_rng(0)
    paths = []
    for number, (height, width) in enumerate([(301, 97), (80, 410), (128, 128), (9, 13)]):
        path = os.path.join(folder, f"photo{number}.jpg")
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path, quality=92)
        paths.append(path)
    return paths


def _reference(run, texts, photos) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain transformers: the run's config, weights and tokenizer as saved, captions cut at the trained length,
    images through the training pipeline's transform, embedded by the family's towers as training embeds."""
    from transformers import AutoConfig, AutoTokenizer

    from vlfit.models.registry import family_for_config

    family = family_for_config(AutoConfig.from_pretrained(run))
    model = family.from_pretrained(run).eval()
    tokenizer = AutoTokenizer.from_pretrained(run)
    tokens = tokenizer(texts, max_length=TRAINED_LENGTH, truncation=True, padding="longest", return_tensors="pt",
                       return_attention_mask=True)  # fmt: skip
    with torch.no_grad():
        text = family.encode_text(model, tokens["input_ids"], tokens["attention_mask"])
        image = family.encode_image(model, _pixels(run, photos))
    return text.float(), image.float()


def _pixels(run, photos) -> torch.Tensor:
    """The photos through the training pipeline's transform, normalised as the run's image processor says."""
    from transformers import AutoImageProcessor

    from vlfit.data.image_transforms import FastImageTransform

    processor = AutoImageProcessor.from_pretrained(run)
    transform = FastImageTransform(processor.crop_size["height"])
    pixels = torch.stack([transform(Path(p).read_bytes(), sample_id=p) for p in photos]).float() / 255
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    return (pixels - mean) / std


def _open_clip_embeddings(run, photos, folder) -> tuple[torch.Tensor, torch.Tensor]:
    """The run exported with ``--format open_clip``, loaded by open_clip itself: its tokenizer's captions, and the
    photos as the run's pixels (open_clip's own transform, which centres a crop a pixel otherwise on odd sizes, is
    held to the run in tests/inference/test_export_open_clip.py)."""
    import open_clip

    from vlfit.cli import main

    assert main(["export", "--model_name_or_path", run, "--output_dir", str(folder), "--format", "open_clip",
                 "--parity_samples", "8"]) == 0  # fmt: skip
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    with torch.no_grad():
        texts = model.encode_text(tokenizer(TEXTS), normalize=True)
        images = model.encode_image(_pixels(run, photos), normalize=True)
    return texts.float(), images.float()


def _cosines(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a).double(), torch.as_tensor(b).double(), dim=1)


def _fewshot_embeddings(run, photos) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``vlfit fewshot`` embeds, opening the run as it does: the zero-shot head's class prompts (``TEXTS`` as the
    class names, one template: the name) and a split's images through its decode and the image tower it tunes."""
    from vlfit.data.sources.images import ImageFilesSource
    from vlfit.evaluation.zeroshot import class_embeddings
    from vlfit.fewshot.images import decode_rows, embed_images
    from vlfit.inference.runtime import ModelRuntime

    encoder = ModelRuntime.open(run, kinds=("checkpoint", "adapters")).encoder
    decoded = decode_rows(ImageFilesSource(photos), range(len(photos)), encoder.spec, batch_size=3)
    images = embed_images(encoder.image_tower, decoded.stacked(range(len(photos))), batch_size=3)
    return class_embeddings(encoder.encode_texts, TEXTS, ["{}"]), images


def _classify_embeddings(run, photos, folder) -> torch.Tensor:
    """What ``vlfit classify`` embeds: the files through a classifier saved from the run and loaded again."""
    from vlfit.data.sources.images import ImageFilesSource
    from vlfit.fewshot.classifier import Classifier, ClassifierInfo, save_classifier
    from vlfit.fewshot.heads import LinearHead
    from vlfit.inference.runtime import ModelRuntime

    encoder = ModelRuntime.open(run).encoder
    head = LinearHead(torch.zeros(2, encoder.identity.embedding_size), torch.zeros(2))
    info = ClassifierInfo("linear_probe", ["a", "b"], "label", 1, 0, "logistic C=10", 1.0, [], run)
    save_classifier(str(folder), encoder.save, head, info)
    classifier = Classifier(str(folder))
    positions, parts = [], []
    for batch, images in classifier.image_batches(ImageFilesSource(photos), batch_size=3):
        positions.extend(batch.positions)
        parts.append(classifier.embed(images))
    return torch.cat(parts)[torch.argsort(torch.tensor(positions))]


def _reranker_embeddings(model, index, photos) -> torch.Tensor:
    """The indexed photos as the re-ranker hands them to the matching head (``candidate_images``), embedded."""
    from vlfit.index.items import IndexedItems
    from vlfit.index.rerank import candidate_images
    from vlfit.index.search import Hit
    from vlfit.index.verify import manifest_stamp

    rows = {os.path.basename(item): row for row, item in enumerate(index.row_ids)}
    hits = [Hit(os.path.basename(p), 1.0, row=rows[os.path.basename(p)]) for p in photos]
    images, position_of = candidate_images(
        model.runtime.image_inputs, IndexedItems(index, manifest_stamp(index.path)), hits
    )
    return model.runtime.encoder.encode_images(**images)[[position_of[hit.row] for hit in hits]]


def _evaluation_embeddings(run, photos, tmp_path, monkeypatch):
    """``(text cosines, image cosines)`` of what evaluation embeds (``vlfit eval`` of a CSV pairing ``TEXTS`` with
    the photos, through the evaluation feed and ``embed_split`` that training's evaluation runs) against plain
    transformers. The split's embeddings are read by a wrapper that records what the real ``embed_split`` returns."""
    import csv

    import vlfit
    from vlfit.evaluation import retrieval

    captions = [*TEXTS, "a small picture"][: len(photos)]
    table = tmp_path / "pairs.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "caption"])
        writer.writerows(zip(photos, captions, strict=True))
    parts = []
    real = retrieval.embed_split

    def recorded(*args, **kwargs):
        parts.append(real(*args, **kwargs))
        return parts[-1]

    monkeypatch.setattr(retrieval, "embed_split", recorded)
    vlfit.evaluate(model_name_or_path=run, validation_file=str(table), output_dir=str(tmp_path / "eval-parity"),
                   per_device_eval_batch_size=2, report_to="none", disable_tqdm=True)  # fmt: skip
    (part,) = parts
    order = torch.argsort(torch.tensor(part.positions))
    texts, images = torch.cat(part.texts)[order], torch.cat(part.images)[order]
    text, image = _reference(run, captions, photos)
    return _cosines(texts, text), _cosines(images, image)


@pytest.mark.parametrize("preset", ["tiny", "clip-tiny", "metaclip2-tiny", "siglip-tiny", "two-tower-tiny"])
def test_every_door_embeds_a_run_as_it_was_trained(preset, synthetic_dataset_dir, tmp_path, caplog, monkeypatch):
    import vlfit
    from vlfit.cli import main
    from vlfit.index.stages import StageTimes
    from vlfit.index.store import EmbeddingIndex
    from vlfit.serve.engine import SearchEngine
    from vlfit.serve.openai_api import embed_items

    run = str(tmp_path / "run")
    vlfit.train(model_preset=preset, dataset_name=synthetic_dataset_dir, output_dir=run, max_steps=1,
                max_seq_length=TRAINED_LENGTH, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                save_strategy="no", report_to="none", disable_tqdm=True, eval_strategy="no")  # fmt: skip
    record = json.loads(Path(run, "input_spec.json").read_text())
    assert record["max_seq_length"] == TRAINED_LENGTH
    photos = _photos(tmp_path)
    text, image = _reference(run, TEXTS, photos)
    figures = {"evaluation": _evaluation_embeddings(run, photos, tmp_path, monkeypatch)}

    model = vlfit.load(run)
    assert model.max_seq_length == TRAINED_LENGTH
    figures["vlfit.load"] = (_cosines(model.encode_texts(TEXTS), text), _cosines(model.encode_images(photos), image))

    index = tmp_path / "index"
    photo_folder = os.path.dirname(photos[0])
    assert main(["retrieve", "index", "--model", run, "--images", photo_folder, "--output_dir", str(index),
                 "--dataloader_num_workers", "0", "--disable_tqdm", "true"]) == 0  # fmt: skip
    built = EmbeddingIndex(str(index))
    assert built.manifest.model["max_seq_length"] == TRAINED_LENGTH
    rows = {os.path.basename(item): row for row, item in enumerate(built.row_ids)}
    stored = built.embeddings()[[rows[os.path.basename(p)] for p in photos]]
    engine = SearchEngine(str(index))  # the server's query path: the index's model as it was built
    figures["retrieve index + serve"] = (_cosines(engine.encode_texts(TEXTS), text), _cosines(stored, image))
    served, _ = embed_items(engine, [*TEXTS, *(Path(p).read_bytes() for p in photos)], 10**8, StageTimes())
    figures["/v1/embeddings"] = (_cosines(served[: len(TEXTS)], text), _cosines(served[len(TEXTS) :], image))
    prompts, shots = _fewshot_embeddings(run, photos)
    figures["fewshot"] = (_cosines(prompts, text), _cosines(shots, image))
    figures["classify"] = (None, _cosines(_classify_embeddings(run, photos, tmp_path / "classifier"), image))
    figures["re-ranker"] = (None, _cosines(_reranker_embeddings(model, built, photos), image))

    export = tmp_path / "export"
    assert main(["export", "--model_name_or_path", run, "--output_dir", str(export), "--parity_samples", "8"]) == 0
    manifest = json.loads((export / "export_manifest.json").read_text())
    assert manifest["text"]["max_seq_length"] == TRAINED_LENGTH and manifest["input_spec"] == record
    exported = vlfit.load(str(export), precision="fp32")
    figures["onnx"] = (_cosines(exported.encode_texts(TEXTS), text), _cosines(exported.encode_images(photos), image))
    if preset in ("clip-tiny", "metaclip2-tiny"):  # the families open_clip expresses
        texts, images = _open_clip_embeddings(run, photos, tmp_path / "open_clip")
        figures["open_clip"] = (_cosines(texts, text), _cosines(images, image))

    print(preset, {door: [None if c is None else round(float(c.min()), 6) for c in cosines]
                   for door, cosines in figures.items()})  # fmt: skip
    for door, (texts_cosine, images_cosine) in figures.items():  # classify and the re-ranker embed no text
        least = 0.999 if door == "onnx" else 0.9999
        assert texts_cosine is None or float(texts_cosine.min()) >= least, (door, texts_cosine)
        assert float(images_cosine.min()) >= least, (door, images_cosine)

    # vlfit eval of the run evaluates it at its length too, unless told otherwise (and then says so).
    flags = {"model_name_or_path": run, "dataset_name": synthetic_dataset_dir, "output_dir": str(tmp_path / "eval"),
             "per_device_eval_batch_size": 16, "report_to": "none", "disable_tqdm": True}  # fmt: skip
    with caplog.at_level("INFO", logger="vlfit.models.loading"):
        caplog.clear()
        vlfit.evaluate(**flags)
        assert "captions are cut at" not in caplog.text
        vlfit.evaluate(**flags, max_seq_length=24)
        assert f"captions are cut at 24 tokens (--max_seq_length), not the {TRAINED_LENGTH}" in caplog.text

    # A caption longer than the trained length embeds as its truncation; asked for longer, it embeds otherwise (and
    # the door says so in one line).
    tokenizer = model.runtime.inputs.tokenizer
    assert len(tokenizer(LONG)["input_ids"]) > TRAINED_LENGTH
    cut = tokenizer.decode(tokenizer(LONG, max_length=TRAINED_LENGTH, truncation=True)["input_ids"],
                           skip_special_tokens=True)  # fmt: skip
    assert float(_cosines(model.encode_texts([LONG]), model.encode_texts([cut]))[0]) >= 0.9999
    with caplog.at_level("INFO", logger="vlfit.models.loading"):
        longer = vlfit.load(run, max_seq_length=64)
    assert f"captions are cut at 64 tokens (--max_seq_length), not the {TRAINED_LENGTH}" in caplog.text
    assert float(_cosines(longer.encode_texts([LONG]), model.encode_texts([LONG]))[0]) < 0.99999  # a BERT: 0.99997


def _camera_photos(folder: Path) -> list[Path]:
    """770 x 577 photos as a camera writes them (JPEG, 4:2:0, noise), upright and turned by their EXIF orientation:
    577 rows are 72 DCT blocks and one row, the size where a decode at 1/8 stands most for padding past the edge."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:577, 0:770].astype(np.float32)
    base = np.stack([255 * x / 770, 255 * y / 577, 128 + 100 * np.sin(x / 17 + y / 23)], -1)
    base[190:290, 150:385] = (250, 20, 20)
    paths = []
    for orientation in (1, 6, 8, 3):
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        exif = Image.Exif()
        exif[0x0112] = orientation
        paths.append(folder / f"camera{orientation}.jpg")
        Image.fromarray(pixels).save(paths[-1], quality=90, exif=exif.tobytes())
    return paths


@pytest.mark.parametrize("preset", ["siglip-tiny", "siglip2-tiny", "clip-tiny", "metaclip2-tiny", "tiny"])
def test_photos_embed_as_plain_transformers_processor_embeds_them(preset, tmp_path):
    """``vlfit.load`` (a DCT-scaled decode, then one resize) against the model folder's own image processor
    (``AutoImageProcessor``: a decode at full size, EXIF orientation applied), on the same camera photos."""
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    import vlfit
    from vlfit.models.family import image_inputs
    from vlfit.models.loading import load_model

    bundle = load_model(model_preset=preset, captions=lambda: TEXTS * 10)
    bundle.save(str(tmp_path / "run"))
    photos = _camera_photos(tmp_path)
    processor = AutoImageProcessor.from_pretrained(tmp_path / "run")
    inputs = processor(images=[load_image(str(path)) for path in photos], return_tensors="pt")
    with torch.no_grad():
        theirs = bundle.family.encode_image(bundle.model.eval(), **image_inputs(inputs))
    ours = vlfit.load(str(tmp_path / "run")).encode_images(photos)
    found = _cosines(ours, theirs)
    print(preset, [round(float(cosine), 6) for cosine in found])
    assert float(found.min()) >= 0.9995, found  # SigLIP: 0.992-0.998 from the pixels' whole extent
