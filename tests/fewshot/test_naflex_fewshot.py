"""``vlfit fewshot`` and ``vlfit classify`` on a SigLIP 2 NaFlex run: each image goes in as the patches of its own
grid, with the mask and grids, as through every other door (SetFit's random views keep each image's grid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlfit.cli import main


@pytest.fixture(scope="module")
def naflex_checkpoint(labelled_dataset_dir, tmp_path_factory) -> Path:
    from vlfit.data.sources import open_splits
    from vlfit.models.loading import load_model

    folder = tmp_path_factory.mktemp("fewshot-naflex") / "model"
    train = open_splits(dataset_name=labelled_dataset_dir)["train"]
    torch.manual_seed(0)
    load_model(model_preset="siglip2-tiny", captions=train.captions, max_num_patches=12).save(str(folder))
    return folder


def test_fewshot_embeds_a_naflex_split_as_vlfit_load_does_and_setfit_views_keep_each_grid(
    naflex_checkpoint, labelled_dataset_dir
) -> None:
    from vlfit.data.sources import labelled_splits
    from vlfit.fewshot.images import decode_rows, embed_images
    from vlfit.fewshot.setfit import random_views
    from vlfit.inference.runtime import ModelRuntime

    _, evaluation = labelled_splits(labelled_dataset_dir, train_split="train", eval_split="test", label_column="kind")
    runtime = ModelRuntime.open(str(naflex_checkpoint))
    rows = range(6)
    images = decode_rows(evaluation.source, rows, runtime.encoder.spec, batch_size=4).stacked(rows)
    assert images["spatial_shapes"].prod(-1).max() <= 12 and len(set(map(tuple, images["spatial_shapes"].tolist()))) > 1
    embedded = embed_images(runtime.encoder.image_tower, images, batch_size=4)
    direct = runtime.embed_images([evaluation.source[row].image for row in rows])
    assert float(torch.nn.functional.cosine_similarity(embedded, direct).min()) >= 0.9999
    views = random_views(images, torch.Generator().manual_seed(0))
    assert torch.equal(views["spatial_shapes"], images["spatial_shapes"])
    assert torch.equal(views["pixel_attention_mask"], images["pixel_attention_mask"])
    assert not torch.equal(views["pixels"], images["pixels"])


@pytest.mark.slow
def test_fewshot_and_classify_take_a_naflex_run(naflex_checkpoint, labelled_dataset_dir, tmp_path, capsys) -> None:
    out = tmp_path / "report"
    classifier = tmp_path / "classifier"
    assert main(["fewshot", "--model_name_or_path", str(naflex_checkpoint), "--dataset_name", labelled_dataset_dir,
                 "--label_column", "kind", "--output_dir", str(out), "--shots", "2", "--seeds", "1",
                 "--setfit_steps", "2", "--methods", "linear_probe,setfit", "--save_classifier",
                 str(classifier)]) == 0  # fmt: skip
    document = json.loads((out / "fewshot.json").read_text())
    assert [(run["method"], run["shots"]) for run in document["runs"]] == [("linear_probe", 2), ("setfit", 2)]
    assert document["eval_images"] == 18 and not document["bad_samples"]
    info = json.loads((classifier / "classifier.json").read_text())
    capsys.readouterr()
    assert main(["classify", "--model", str(classifier), "--dataset_name", labelled_dataset_dir, "--split", "test",
                 "--label_column", "kind", "--dataloader_num_workers", "0"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert len([line for line in printed.splitlines() if "\t" in line]) == 18
    # The saved model and head classify the split as the run measured them in memory.
    correct = round(info["accuracy"] * 18)
    assert f"accuracy against 'kind': {correct / 18:.4f} ({correct}/18)" in printed
