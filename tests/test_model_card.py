"""Model cards: the hub's YAML header, the run's metrics and command, code that embeds as vlfit does; written by
``vlfit merge-lora`` and by a saved few-shot classifier."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.models.test_transformers_parity import (
    PLAIN,
    TEXTS,
    TRAINING_CAPTIONS,
    pil_images,
    png_images,
    vlfit_embeddings,
)
from vlfit import __version__
from vlfit.model_card import MODEL_CARD_FILE, WiseFtMix, write_model_card
from vlfit.models.loading import load_model

METRICS = {"eval_text_to_image_recall@1": 0.123456, "train_loss": 2.5, "epoch": 3.0}


def read_card(folder: Path) -> tuple[dict, str]:
    """The card's YAML header (parsed) and its body."""
    text = (folder / MODEL_CARD_FILE).read_text(encoding="utf-8")
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def code_block(body: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    return code


def test_the_header_is_hub_metadata_and_the_body_names_the_run(tmp_path):
    local_data = tmp_path / "data"
    local_data.mkdir()
    base = "openai/clip-vit-base-patch32"
    write_model_card(str(tmp_path / "run"), family_name="clip", base_model=base, preset=None,
                     datasets=["nlphuji/flickr30k", str(local_data)], metrics=METRICS,
                     command_line=f"vlfit train --model_name_or_path {base}", license="mit")  # fmt: skip
    header, body = read_card(tmp_path / "run")
    assert header == {
        "library_name": "transformers",
        "license": "mit",
        "base_model": base,
        "tags": ["vlfit", "clip"],
        "datasets": ["nlphuji/flickr30k"],  # the hub reads these as repositories: a local folder is named below
        "pipeline_tag": "zero-shot-image-classification",
    }
    assert f"fine-tuned version of [{base}](https://huggingface.co/{base})" in body
    assert str(local_data) in body
    assert "| eval_text_to_image_recall@1 | 0.1235 |" in body and "| train_loss | 2.5 |" in body
    assert f"```bash\nvlfit train --model_name_or_path {base}\n```" in body
    assert f"vlfit {__version__}" in body and "`mit`" in body
    assert "CLIPModel.from_pretrained(path)" in code_block(body)


def test_a_preset_run_names_its_preset_and_lora_adapters_load_through_peft(tmp_path):
    write_model_card(str(tmp_path / "run"), family_name="bridgetower", base_model=None, preset="tiny", datasets=[],
                     metrics=None, command_line=None, adapters=True)  # fmt: skip
    header, body = read_card(tmp_path / "run")
    assert header == {"library_name": "peft", "license": "other", "tags": ["vlfit", "bridgetower", "lora"]}
    assert "vlfit's `tiny` preset" in body and "No metrics were recorded." in body
    assert "The command line was not recorded." in body
    code = code_block(body)
    assert "PeftModel.from_pretrained(BridgeTowerForContrastiveLearning.from_pretrained(" in code
    assert "vlfit merge-lora" in body


@pytest.mark.parametrize("family", sorted(PLAIN))
def test_the_cards_code_embeds_captions_and_images_as_vlfit_does(family, tmp_path, monkeypatch):
    import tests.models.test_transformers_parity as parity

    texts = [*TEXTS, "two red circles on the left " * 30]  # longer than the run's caption length: cut where it cut
    monkeypatch.setattr(parity, "TEXTS", texts)  # what vlfit_embeddings embeds
    preset, _ = PLAIN[family]
    torch.manual_seed(0)
    bundle = load_model(model_preset=preset, captions=lambda: TRAINING_CAPTIONS)
    folder = tmp_path / "model"
    bundle.save(str(folder))
    write_model_card(str(folder), family_name=family, base_model=None, preset=preset, datasets=[], metrics=None,
                     command_line=None)  # fmt: skip
    images = png_images(bundle.image_size, len(texts))
    # The card's code, run on this folder, these captions and these images instead of its placeholders.
    code = code_block(read_card(folder)[1])
    code = re.sub(r"^path = .*$", "path = FOLDER", code, flags=re.M)
    code = re.sub(r"^texts = .*$", "texts = TEXTS", code, flags=re.M)
    code = re.sub(r"^images = .*$", "images = IMAGES", code, flags=re.M)
    namespace = {"FOLDER": str(folder), "TEXTS": texts, "IMAGES": pil_images(images)}
    exec(compile(code, "model card", "exec"), namespace)
    ours = vlfit_embeddings(bundle, images)
    for mine, theirs in ((ours.text, namespace["text_embeds"]), (ours.image, namespace["image_embeds"])):
        assert torch.nn.functional.cosine_similarity(mine, theirs, dim=-1).min() >= 0.999


def test_merge_lora_writes_a_card_with_the_runs_datasets_license_and_metrics(tmp_path):
    from vlfit.commands import merge_lora
    from vlfit.models.lora import LoraSettings, apply_lora

    bundle = load_model(model_preset="clip-tiny", captions=lambda: TRAINING_CAPTIONS)
    run = tmp_path / "run"
    bundle.model.save_pretrained(run / "base_model")
    adapted = apply_lora(bundle.family, bundle.model, LoraSettings(r=2, targets=("q_proj",)))
    for config in adapted.peft_config.values():
        config.base_model_name_or_path = "base_model"  # as a preset's run records it
    adapted.save_pretrained(run)
    bundle.tokenizer.save_pretrained(run)
    bundle.image_processor.save_pretrained(run)
    (run / "all_results.json").write_text(json.dumps(METRICS))
    write_model_card(str(run), family_name="clip", base_model=None, preset="clip-tiny", datasets=["nlphuji/flickr30k"],
                     metrics=METRICS, command_line="vlfit train ...", license="mit", adapters=True)  # fmt: skip

    out = tmp_path / "merged"
    assert merge_lora.main(["--model_name_or_path", str(run), "--output_dir", str(out)]) == 0
    header, body = read_card(out)
    assert header["library_name"] == "transformers" and header["license"] == "mit"
    assert header["datasets"] == ["nlphuji/flickr30k"] and header["tags"] == ["vlfit", "clip"]
    assert "base_model" not in header  # a local folder (the preset's initial weights)
    assert f"`{run}` are merged" in body and "| eval_text_to_image_recall@1 | 0.1235 |" in body
    assert f"vlfit merge-lora --model_name_or_path {run} --output_dir {out}" in body


def test_a_saved_classifier_has_a_card_beside_its_checkpoint(tmp_path):
    from vlfit.fewshot.classifier import HEAD_FILE, MODEL_FOLDER, ClassifierInfo, save_classifier
    from vlfit.fewshot.heads import LinearHead

    bundle = load_model(model_preset="siglip-tiny", captions=lambda: TRAINING_CAPTIONS)
    info = ClassifierInfo("setfit", ["circle", "square"], "kind", 4, 1, "logistic", 0.875, [], str(tmp_path / "src"))
    head = LinearHead(torch.randn(2, 64), torch.zeros(2))
    save_classifier(str(tmp_path / "clf"), bundle.save, head, info, dataset="nlphuji/shapes",
                    command_line="vlfit fewshot --dataset_name nlphuji/shapes")  # fmt: skip
    header, body = read_card(tmp_path / "clf" / MODEL_FOLDER)
    assert header["tags"] == ["vlfit", "siglip"] and header["datasets"] == ["nlphuji/shapes"]
    assert header["pipeline_tag"] == "zero-shot-image-classification"
    assert "| eval_accuracy | 0.875 |" in body and "| shots_per_class | 4 |" in body
    assert "SetFit's recipe on 4 labelled images per class" in body and HEAD_FILE in body
    assert "vlfit fewshot --dataset_name nlphuji/shapes" in body


def test_a_mix_names_both_models_and_alpha_and_a_linear_probe_claims_no_fine_tuning(tmp_path):
    from vlfit.fewshot.classifier import MODEL_FOLDER, ClassifierInfo, save_classifier
    from vlfit.fewshot.heads import LinearHead
    from vlfit.model_card import WiseFtMix

    zeroshot, finetuned = "openai/clip-vit-base-patch32", "someone/clip-flickr"
    write_model_card(str(tmp_path / "mix"), family_name="clip", base_model=None, preset=None, datasets=[],
                     metrics=None, command_line=None, mix=WiseFtMix(0.3, zeroshot, finetuned))  # fmt: skip
    header, body = read_card(tmp_path / "mix")
    assert header["base_model"] == [zeroshot, finetuned] and header["base_model_relation"] == "merge"
    assert header["tags"] == ["vlfit", "clip", "wise-ft"]
    assert f"(1 - 0.3) x the zero-shot model [{zeroshot}](https://huggingface.co/{zeroshot}) + 0.3 x the " \
           f"fine-tuned model [{finetuned}](https://huggingface.co/{finetuned}) (alpha 0.3" in body  # fmt: skip
    assert "fine-tuned version" not in body and "(see the base models' licenses)" in body

    bundle = load_model(model_preset="clip-tiny", captions=lambda: TRAINING_CAPTIONS)
    info = ClassifierInfo(
        "linear_probe", ["circle", "square"], "kind", 4, 1, "logistic", 0.875, [], str(tmp_path / "src")
    )
    save_classifier(str(tmp_path / "clf"), bundle.save, LinearHead(torch.randn(2, 64), torch.zeros(2)), info)
    _, body = read_card(tmp_path / "clf" / MODEL_FOLDER)
    assert f"holds the weights of `{tmp_path / 'src'}`, unchanged" in body and "fine-tuned version" not in body


def test_names_the_hub_refuses_as_repository_ids_stay_out_of_the_header(tmp_path):
    from huggingface_hub import ModelCard

    base, refused = "openai/clip-vit-base-patch32", ["team/captions--v2", "team/flickr.git", "someone/clip-ft..old"]
    write_model_card(str(tmp_path / "run"), family_name="clip", base_model=refused[2], preset=None,
                     datasets=["nlphuji/flickr30k", *refused[:2]], metrics=None, command_line=None)  # fmt: skip
    header, body = read_card(tmp_path / "run")
    assert header["datasets"] == ["nlphuji/flickr30k"] and "base_model" not in header  # not repositories
    assert all(f"`{name}`" in body for name in refused)  # named in the text, not linked to the hub
    card = ModelCard.load(tmp_path / "run" / MODEL_CARD_FILE)  # as the hub library reads it, offline
    assert card.data.to_dict() == header

    write_model_card(str(tmp_path / "mix"), family_name="clip", base_model=None, preset=None, datasets=[],
                     metrics=None, command_line=None, mix=WiseFtMix(0.5, base, refused[0]))  # fmt: skip
    assert read_card(tmp_path / "mix")[0]["base_model"] == [base]
