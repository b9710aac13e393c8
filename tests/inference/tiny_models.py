"""Tiny random-init checkpoints, saved as ``vlfit train`` saves one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vlfit.data.sources import open_splits


def save_tiny_checkpoint(dataset_dir: str, output_dir: Path, seed: int = 0, preset: str = "tiny") -> Path:
    """A random-init checkpoint folder of a (tiny) preset with its tokenizer (trained on the dataset's captions) and
    image processor, as ``vlfit train`` saves one."""
    from vlfit.arguments import ModelArguments
    from vlfit.models.loading import build_model, resolve_model

    args = ModelArguments(model_preset=preset)
    train = open_splits(dataset_name=dataset_dir)["train"]
    spec = resolve_model(**args.source_keywords(), captions=train.captions)
    torch.manual_seed(seed)
    model = build_model(spec, **args.build_keywords())
    model.save_pretrained(output_dir)
    spec.inputs.tokenizer.save_pretrained(output_dir)
    spec.image_processor.save_pretrained(output_dir)
    return output_dir


def write_image_folder(dataset_dir: str, folder: Path) -> Path:
    """The validation and test images of the dataset as JPEG files in two sub-folders, plus one file that is not an
    image (``test/broken.jpg``)."""
    splits = open_splits(dataset_name=dataset_dir)
    for split in ("validation", "test"):
        (folder / split).mkdir(parents=True)
        for record in splits[split]:
            (folder / split / f"{record.id}.jpg").write_bytes(record.image)
    (folder / "test" / "broken.jpg").write_bytes(b"not a jpeg at all")
    return folder


def save_itm_checkpoint(checkpoint: Path, output_dir: Path, seed: int = 2) -> Path:
    """``checkpoint`` with a new matching head (initialized as transformers does), saved as vlfit train saves a run
    of ``--objective contrastive+itm``."""
    from transformers import BridgeTowerForContrastiveLearning

    from vlfit.models.itm import with_itm_head

    model = BridgeTowerForContrastiveLearning.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    with_itm_head(model).save_pretrained(output_dir)
    for path in checkpoint.iterdir():  # the tokenizer and image processor
        if not (output_dir / path.name).exists():
            shutil.copy(path, output_dir / path.name)
    return output_dir


def save_metaclip2_checkpoint(captions: list[str], output_dir: Path, seed: int = 0) -> Path:
    """A random-init MetaCLIP 2 folder laid out as the hub's ``facebook/metaclip-2-worldwide-*`` ones are:
    ``MetaClip2Model.save_pretrained`` (``metaclip2-tiny``'s shapes), an XLM-R tokenizer (a SentencePiece Unigram with
    XLM-R's special tokens, trained here on ``captions``; the real one has 901k pieces) and CLIP's image processor,
    and no ``input_spec.json`` (vlfit never trained it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import MetaClip2Model, XLMRobertaTokenizer

    from vlfit.models.registry import family_for_preset

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=600, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)  # fmt: skip
    unigram.train_from_iterator(captions, trainer)
    pieces = [(piece, score) for piece, score in json.loads(unigram.to_str())["model"]["vocab"]]
    tokenizer = XLMRobertaTokenizer(vocab=[*pieces, ("<mask>", 0.0)], model_max_length=77)
    family = family_for_preset("metaclip2-tiny")
    torch.manual_seed(seed)
    MetaClip2Model(family.preset_config("metaclip2-tiny")).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    family.preset_image_processor("metaclip2-tiny").save_pretrained(output_dir)
    return output_dir
