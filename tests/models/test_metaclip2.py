"""MetaCLIP 2 (``MetaClip2Model``) through the CLIP family: captions in several scripts tokenize and embed apart, the
text tower pools where its tokenizer ends a caption (a tokenizer that ends it elsewhere is refused), and a folder
laid out as the hub's checkpoints (XLM-R tokenizer, no vlfit record) trains and evaluates on multilingual captions
and is run by the doors (``vlfit.load``, ``retrieve index``, ``vlfit serve``, the Immich export) as plain
transformers' ``MetaClip2Model`` runs it (``metaclip2-tiny`` is in every door's parity test,
``tests/inference/test_runtime_parity.py``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vlfit
from vlfit.models.loading import load_model, resolve_model

ENGLISH = ["a red circle on a white wall", "two blue squares at the top", "three green crosses near a tree"] * 10
# Two distinct captions in each script; none of their characters is in ENGLISH.
SCRIPTS = {
    "latin": ["un cercle rouge sur le mur", "zwei blaue Quadrate oben"],
    "cyrillic": ["красный круг на белой стене", "два синих квадрата сверху"],
    "cjk": ["白い壁に赤い丸", "顶部有两个蓝色方块"],
    "arabic": ["دائرة حمراء على جدار أبيض", "مربعان أزرقان في الأعلى"],
    "devanagari": ["सफ़ेद दीवार पर लाल घेरा", "ऊपर दो नीले वर्ग"],
}
MULTILINGUAL = [caption for pair in SCRIPTS.values() for caption in pair]


def _cosines(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a).double(), torch.as_tensor(b).double(), dim=1)


def test_captions_in_every_script_tokenize_and_embed_apart_with_the_presets_tokenizer():
    """The preset's byte-level BPE, trained on English captions only, still spells every script (no unknown token,
    decoded back whole) and ends each caption with the id the text tower pools at, cut or not."""
    bundle = load_model(model_preset="metaclip2-tiny", captions=lambda: ENGLISH)
    tokenizer = bundle.tokenizer
    eos = bundle.model.config.text_config.eos_token_id
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (eos, 1, 0) == (2, 1, 0)
    ids = [tokenizer(caption)["input_ids"] for caption in MULTILINGUAL]
    for caption, tokens in zip(MULTILINGUAL, ids, strict=True):
        assert tokenizer.unk_token_id not in tokens, caption
        assert tokenizer.decode(tokens, skip_special_tokens=True).strip() == caption
        assert tokens[-1] == eos and tokens.count(eos) == 1, caption
    assert len({tuple(tokens) for tokens in ids}) == len(MULTILINGUAL)

    batch = bundle.inputs.tokenize(MULTILINGUAL)  # padded to the longest, cut at the run's length
    cut = resolve_model(model_preset="metaclip2-tiny", captions=lambda: ENGLISH, max_seq_length=8).inputs
    short = cut.tokenize(MULTILINGUAL)["input_ids"]
    assert short.shape[1] == 8 and (short[:, -1] == eos).all()  # every caption is longer: cut, its end kept
    with torch.no_grad():
        texts = bundle.family.encode_text(bundle.model.eval(), batch["input_ids"], batch["attention_mask"])
    similarity = texts @ texts.T
    assert float((similarity - torch.eye(len(MULTILINGUAL))).max()) < 0.9999  # no two captions embed alike


def test_a_tokenizer_that_ends_captions_elsewhere_is_refused(tmp_path):
    """A CLIP preset's tokenizer ends captions with id 4; MetaCLIP 2's tower would pool every caption at its first
    token."""
    clip = load_model(model_preset="clip-tiny", captions=lambda: ENGLISH)
    clip.tokenizer.save_pretrained(tmp_path / "clip-tokenizer")
    with pytest.raises(vlfit.ConfigError, match=r"ends a caption with id 4 .* pools at the first token 2 "):
        resolve_model(model_preset="metaclip2-tiny", tokenizer_name=str(tmp_path / "clip-tokenizer"))


def _photos(folder: Path, count: int) -> list[str]:
    """PNG photos at the model's input size (64 px: neither side resizes), a gradient and a block each."""
    rng = np.random.default_rng(0)
    paths = []
    for number in range(count):
        pixels = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
        pixels[8 * (number % 6) : 8 * (number % 6) + 16, 10:40] = (250, 20 * number, 20)
        paths.append(str(folder / f"photo{number}.png"))
        Image.fromarray(pixels).save(paths[-1])
    return paths


def _plain(folder: str, texts: list[str], photos: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain transformers, as MetaCLIP 2's model card calls it: ``AutoModel`` (a ``MetaClip2Model``),
    ``AutoProcessor`` with ``padding=True`` (and ``truncation=True``: the saved tokenizer cuts at the run's length),
    the two feature methods."""
    from transformers import AutoModel, AutoProcessor, MetaClip2Model

    model = AutoModel.from_pretrained(folder).eval()
    assert isinstance(model, MetaClip2Model)
    processor = AutoProcessor.from_pretrained(folder)
    images = [Image.open(path).convert("RGB") for path in photos]
    inputs = processor(text=texts, images=images, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        image = model.get_image_features(pixel_values=inputs["pixel_values"])
    return text.pooler_output, image.pooler_output


def test_a_hub_folder_loads_as_plain_transformers_loads_it(tmp_path):
    from tests.inference.tiny_models import save_metaclip2_checkpoint

    base = str(save_metaclip2_checkpoint(ENGLISH + MULTILINGUAL, tmp_path / "base"))
    photos = _photos(tmp_path, 3)
    model = vlfit.load(base)
    assert model.runtime.encoder.loaded.family.name == "metaclip2" and model.max_seq_length == 77
    text, image = _plain(base, MULTILINGUAL, photos)
    assert float(_cosines(model.encode_texts(MULTILINGUAL), text).min()) >= 0.9999
    assert float(_cosines(model.encode_images(photos), image).min()) >= 0.9999


@pytest.mark.slow
def test_a_hub_folder_trains_on_multilingual_captions_and_the_doors_run_it(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from tests.inference.test_export_immich import ImmichClip
    from tests.inference.tiny_models import save_metaclip2_checkpoint
    from vlfit.cli import main
    from vlfit.serve.app import create_app
    from vlfit.serve.engine import SearchEngine

    monkeypatch.chdir(tmp_path)
    base = str(save_metaclip2_checkpoint(ENGLISH + MULTILINGUAL, tmp_path / "base"))
    (tmp_path / "photos").mkdir()
    photos = _photos(tmp_path / "photos", len(MULTILINGUAL))
    table = tmp_path / "pairs.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("image", "caption"), *zip(photos, MULTILINGUAL, strict=True)])

    run = str(tmp_path / "run")
    vlfit.train(model_name_or_path=base, train_file=str(table), validation_file=str(table), output_dir=run,
                max_steps=2, max_seq_length=24, per_device_train_batch_size=5, per_device_eval_batch_size=10,
                save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True)  # fmt: skip
    metrics = vlfit.evaluate(model_name_or_path=run, validation_file=str(table), output_dir=str(tmp_path / "eval"),
                             per_device_eval_batch_size=10, report_to="none", disable_tqdm=True).metrics  # fmt: skip
    assert metrics["eval_num_texts"] == len(MULTILINGUAL) and 0 <= metrics["eval_t2i_recall@1"] <= 1

    text, image = _plain(run, MULTILINGUAL, photos)
    model = vlfit.load(run)
    assert model.max_seq_length == 24
    texts = model.encode_texts(MULTILINGUAL)
    figures = {"vlfit.load": (_cosines(texts, text), _cosines(model.encode_images(photos), image))}

    index = tmp_path / "index"
    assert main(["retrieve", "index", "--model", run, "--images", str(tmp_path / "photos"), "--output_dir",
                 str(index), "--dataloader_num_workers", "0", "--disable_tqdm", "true"]) == 0  # fmt: skip
    engine = SearchEngine(str(index))
    with TestClient(create_app(engine, reload_interval=0), base_url="http://127.0.0.1:8000") as client:
        answer = client.post("/api/search", json={"text": SCRIPTS["cyrillic"][0], "k": 3})
    assert answer.status_code == 200 and len(answer.json()["results"]) == 3
    figures["serve"] = (_cosines(engine.encode_texts(MULTILINGUAL), text), None)

    # The ONNX export's graphs are metaclip2-tiny's in tests/inference/test_runtime_parity.py; Immich tokenizes
    # from the folder's tokenizer.json itself (here the XLM-R Unigram).
    immich = tmp_path / "immich"
    assert main(["export", "--model_name_or_path", run, "--output_dir", str(immich), "--format", "immich",
                 "--calibration_dataset", str(table), "--parity_samples", "8"]) == 0  # fmt: skip
    clip = ImmichClip(immich)
    figures["immich"] = (_cosines(np.stack([clip.text(caption) for caption in MULTILINGUAL]), text),
                         _cosines(np.stack([clip.image(Path(p).read_bytes()) for p in photos]), image))  # fmt: skip

    print({door: [None if c is None else round(float(c.min()), 6) for c in pair] for door, pair in figures.items()})
    for door, (texts_cosine, images_cosine) in figures.items():
        least = 0.999 if door == "immich" else 0.9999
        assert float(texts_cosine.min()) >= least, (door, texts_cosine)
        assert images_cosine is None or float(images_cosine.min()) >= least, (door, images_cosine)
    assert json.loads((immich / "textual" / "tokenizer_config.json").read_text())["pad_token"] == "<pad>"
