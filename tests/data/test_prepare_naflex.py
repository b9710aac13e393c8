"""``vlfit prepare`` for a SigLIP 2 NaFlex model: each image is stored at its patch grid, and training on the shards
cuts the same grid without resizing again, embedding as plain transformers embeds the original photos."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image

from tests.models.test_siglip2 import PHOTOS, pipeline_batch, plain_images, siglip2_folder  # noqa: F401 (fixture)
from vlfit.data.naflex import image_header, patch_grid
from vlfit.data.prepare import prepare_dataset, resolve_patch_budget
from vlfit.data.prepare.reencode import prepare_grid_image
from vlfit.data.records import Record
from vlfit.data.sources.memory import MemorySource
from vlfit.data.sources.openers import open_splits
from vlfit.models.family import image_inputs
from vlfit.models.loading import load_model


def test_a_naflex_checkpoint_prepares_at_its_patch_grids(siglip2_folder, tmp_path: Path):  # noqa: F811
    assert resolve_patch_budget(model_name_or_path=siglip2_folder) == (16, 16)
    assert resolve_patch_budget(model_preset="siglip2-small") == (16, 256)
    assert resolve_patch_budget(model_preset="siglip-tiny") is None

    originals = {kind: make() for kind, make in PHOTOS.items()}
    prepared = {kind: prepare_grid_image(data, 16, 16).data for kind, data in originals.items()}
    for kind, data in prepared.items():
        height, width, _ = image_header(originals[kind])
        assert Image.open(io.BytesIO(data)).size[::-1] == patch_grid(height, width, 16, 16), kind

    # vlfit prepare writes them so; training reads the shards: the same grids, and embeddings as plain transformers'
    # of the original photos.
    records = [Record(str(i), data, "a photo") for i, data in enumerate(originals.values())]
    summary = prepare_dataset({"train": MemorySource(records, "photos")}, str(tmp_path / "prepared"), short_side=64,
                              patch_budget=(16, 16), progress=False)  # fmt: skip
    assert summary.totals.rows == len(records)
    shards = open_splits(dataset_name=str(tmp_path / "prepared"), caption_column="image_description")["train"]
    assert sorted(shards[i].image for i in range(len(shards))) == sorted(prepared.values())
    files = []
    for index, data in enumerate(prepared.values()):
        files.append(tmp_path / f"{index}.jpg")
        files[-1].write_bytes(data)
    bundle = load_model(model_name_or_path=siglip2_folder)
    batch = pipeline_batch(bundle, files)
    originals_dir = tmp_path / "originals"
    originals_dir.mkdir()
    original_files = []
    for index, data in enumerate(originals.values()):
        original_files.append(originals_dir / f"{index}.img")
        original_files[-1].write_bytes(data)
    theirs, plain = plain_images(siglip2_folder, original_files)
    assert torch.equal(batch["spatial_shapes"], plain["spatial_shapes"].long())
    with torch.no_grad():
        ours = bundle.family.encode_image(bundle.model.eval(), **image_inputs(batch.inputs))
    cosines = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    assert cosines.min() >= 0.999, dict(zip(PHOTOS, cosines.tolist(), strict=True))
