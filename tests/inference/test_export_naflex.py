"""``vlfit export`` of a SigLIP 2 NaFlex run: the image graph takes uint8 patches, their mask and grids, the patch
count a dynamic axis, and embeds photos of every shape (a different count each) as the PyTorch model does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import vlfit
from tests.models.test_siglip2 import CAPTIONS, PHOTOS
from vlfit.cli import main
from vlfit.inference.identity import RefusedModelError
from vlfit.models.loading import load_model

pytestmark = pytest.mark.slow


def test_an_exported_naflex_run_embeds_photos_of_any_patch_count_as_pytorch(tmp_path, synthetic_dataset_dir):
    torch.manual_seed(0)
    model = tmp_path / "model"
    load_model(model_preset="siglip2-tiny", captions=lambda: CAPTIONS).save(str(model))
    exported = tmp_path / "onnx"
    # Exported for a budget below the run's 16 (--max_num_patches): the export records it and embeds at it.
    assert main(["export", "--model_name_or_path", str(model), "--output_dir", str(exported), "--parity_samples",
                 "9", "--calibration_dataset", synthetic_dataset_dir, "--max_num_patches", "12"]) == 0  # fmt: skip
    manifest = json.loads((exported / "export_manifest.json").read_text())
    assert [item["name"] for item in manifest["inputs"]["image"]] == ["pixels", "pixel_attention_mask",
                                                                      "spatial_shapes"]  # fmt: skip
    assert manifest["inputs"]["image"][0]["shape"] == ["batch", "patches", 16 * 16 * 3]
    assert manifest["image"]["max_num_patches"] == 12
    assert manifest["parity"]["fp32"]["image"]["min_cosine"] >= 0.9999

    photos = [make() for make in PHOTOS.values()]
    reference = vlfit.load(str(model), max_num_patches=12).encode_images(photos)
    graphs = vlfit.load(str(exported), precision="fp32")
    together = graphs.encode_images(photos)  # padded to the longest of the batch
    alone = np.concatenate([graphs.encode_images([photo]) for photo in photos])  # each at its own patch count
    assert (reference * together).sum(1).min() >= 0.9999
    assert (reference * alone).sum(1).min() >= 0.9999

    # A smaller budget at the door is within the graph's patch axis; a larger one is refused in one line.
    assert vlfit.load(str(exported), precision="fp32", max_num_patches=8).encode_images(photos).shape[0] == len(photos)
    with pytest.raises(RefusedModelError, match="`max_num_patches=64` is more than the 12 patches"):
        vlfit.load(str(exported), precision="fp32", max_num_patches=64)
