"""``vlfit export --format open_clip``: the folder is loaded by open_clip itself (``create_model_and_transforms`` and
``get_tokenizer`` on ``local-dir:``) and embeds photos, through open_clip's own transform, and captions, through its
own tokenizer, as ``vlfit.load`` of the run embeds them; the run's caption length and image settings are the
folder's; the families open_clip cannot load are refused in one line."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import vlfit
from tests.serve.browser import under_ci
from vlfit.cli import main
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.models.input_spec_file import save_input_settings

SHORT_CAPTIONS = 16  # the caption length the CLIP run below was trained at (its input_spec.json)
CAPTIONS = ["one red circle", "two blue squares and a green cross", "a yellow triangle above three circles",
            " ".join(["one red circle and"] * 10) + " a cross"]  # the last far over 16 tokens  # fmt: skip


@pytest.fixture(scope="module")
def open_clip():
    """open_clip, or a skip saying why (a failure under CI, which installs it: requirements/ci.txt)."""
    try:
        import open_clip
    except ImportError:
        reason = "open_clip is not installed: pip install 'vlfit[open_clip]'"
        if under_ci(os.environ):
            pytest.fail(f"{reason} (CI=true: a missing open_clip fails this test instead of skipping it)")
        pytest.skip(reason)
    return open_clip


@pytest.fixture(scope="module")
def clip_run(synthetic_dataset_dir, tmp_path_factory) -> Path:
    """A random-init CLIP run at CLIP's 224 px (clip-tiny's towers, 32 px patches) trained at 16-token captions."""
    from tests.inference.tiny_models import save_tiny_checkpoint
    from vlfit.inference.runtime import ModelRuntime
    from vlfit.models.presets import PRESET_FOLDER

    folder = tmp_path_factory.mktemp("open-clip-run")
    preset = json.loads((PRESET_FOLDER / "clip-tiny.json").read_text())
    preset["config"]["vision_config"].update(image_size=224, patch_size=32)
    preset["image_processor"].update(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    (folder / "clip-224.json").write_text(json.dumps(preset))
    run = save_tiny_checkpoint(synthetic_dataset_dir, folder / "run", preset=str(folder / "clip-224.json"))
    spec = ModelRuntime.open(str(run), RuntimeSettings(backend="torch", max_seq_length=SHORT_CAPTIONS)).encoder.spec
    save_input_settings(spec, str(run))  # as vlfit train --max_seq_length 16 records it
    return run


@pytest.fixture(scope="module")
def exported(open_clip, clip_run, synthetic_dataset_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("open-clip") / "export"
    assert main(["export", "--model_name_or_path", str(clip_run), "--output_dir", str(out), "--format", "open_clip",
                 "--calibration_dataset", synthetic_dataset_dir, "--parity_samples", "8"]) == 0  # fmt: skip
    return out


def _photos() -> dict[str, bytes]:
    """A photo (matplotlib's sample, 512x600 JPEG), crops and a resize of it at other aspect ratios, and a landscape
    JPEG whose EXIF orientation (6) shows it portrait."""
    import matplotlib.cbook

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        portrait = f.read()
    picture = Image.open(io.BytesIO(portrait)).convert("RGB")

    def encoded(image: Image.Image, fmt: str, **options) -> bytes:
        out = io.BytesIO()
        image.save(out, fmt, **options)
        return out.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turn 90 degrees clockwise to show
    return {
        "512x600 jpeg": portrait,
        "512x300 jpeg": encoded(picture.crop((0, 100, 512, 400)), "JPEG"),
        "200x600 png": encoded(picture.crop((150, 0, 350, 600)), "PNG"),
        # resized to 224x227: a crop offset of 1.5 px, which torchvision's CenterCrop rounds to 2 and vlfit to 1
        "512x519 png": encoded(picture.resize((512, 519)), "PNG"),
        "exif-rotated jpeg": encoded(
            picture.crop((0, 0, 512, 400)).transpose(Image.Transpose.ROTATE_90), "JPEG", exif=exif.tobytes()
        ),  # fmt: skip
    }


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.slow
def test_open_clip_embeds_photos_and_captions_as_vlfit_does(open_clip, exported, clip_run) -> None:
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{exported}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{exported}")
    model.eval()
    run = vlfit.load(str(clip_run))
    for name, photo in _photos().items():
        # open_clip's transform does not read the EXIF orientation: the caller turns the photo, as vlfit does
        picture = ImageOps.exif_transpose(Image.open(io.BytesIO(photo))).convert("RGB")
        with torch.no_grad():
            theirs = model.encode_image(preprocess(picture).unsqueeze(0), normalize=True)[0].numpy()
        cosine = _cosine(theirs, run.encode_images(photo)[0])
        assert cosine >= 0.999, f"{name}: {cosine}"
    with torch.no_grad():
        theirs = model.encode_text(tokenizer(CAPTIONS), normalize=True).numpy()
    for caption, ours, other in zip(CAPTIONS, run.encode_texts(CAPTIONS), theirs, strict=True):
        assert _cosine(other, ours) >= 0.9999, caption
    assert tokenizer(CAPTIONS).shape == (len(CAPTIONS), SHORT_CAPTIONS)  # cut where the run was trained
    # open_clip's tokenizer cleans every caption first (ftfy, HTML entities, runs of whitespace), which no setting
    # turns off: a caption with those embeds as its cleaned text does in vlfit
    with torch.no_grad():
        spaced = model.encode_text(tokenizer(["  a yellow   triangle &amp; three circles "]), normalize=True)[0]
    assert _cosine(spaced.numpy(), run.encode_texts(["a yellow triangle & three circles"])[0]) >= 0.9999


@pytest.mark.slow
def test_the_folder_has_open_clips_layout_and_the_runs_inputs(exported, clip_run) -> None:
    runtime = vlfit.load(str(clip_run)).runtime
    spec = runtime.encoder.spec
    config = json.loads((exported / "open_clip_config.json").read_text())
    model_cfg, preprocess = config["model_cfg"], config["preprocess_cfg"]
    assert model_cfg["embed_dim"] == runtime.encoder.identity.embedding_size
    assert model_cfg["vision_cfg"]["image_size"] == 224 and model_cfg["vision_cfg"]["patch_size"] == 32
    assert model_cfg["text_cfg"]["context_length"] == SHORT_CAPTIONS
    # clip-tiny's tokenizer ends a caption with </s> at id 4, where CLIPModel pools
    assert (model_cfg["text_cfg"]["pool_type"], model_cfg["text_cfg"]["eos_id"]) == ("eos", 4)
    assert (preprocess["size"], preprocess["resize_mode"], preprocess["interpolation"]) == ([224, 224], "shortest",
                                                                                            "bicubic")  # fmt: skip
    assert preprocess["mean"] == pytest.approx(list(spec.image_mean))
    assert preprocess["std"] == pytest.approx(list(spec.image_std))
    assert (exported / "open_clip_model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    record = json.loads((exported / "vlfit_export.json").read_text())
    assert record["format"] == "open_clip" and record["parity"]["text"]["min_cosine"] >= 0.9999


def test_the_legacy_eos_id_of_clip_configs_pools_at_the_highest_id() -> None:
    """transformers' CLIPModel pools at the highest id when its config's eos_token_id is 2 (OpenAI's checkpoints as
    first converted); MetaCLIP 2 always pools at its eos_token_id."""
    from transformers import CLIPConfig, MetaClip2Config

    from vlfit.inference.export_open_clip import _pooling

    assert _pooling(CLIPConfig(text_config={"eos_token_id": 2})) == {"pool_type": "argmax"}
    assert _pooling(CLIPConfig(text_config={"eos_token_id": 49407})) == {"pool_type": "eos", "eos_id": 49407}
    assert _pooling(MetaClip2Config(text_config={"eos_token_id": 2})) == {"pool_type": "eos", "eos_id": 2}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "says"),
    [("siglip-tiny", "is a siglip model: open_clip builds SigLIP's image tower from a named timm architecture"),
     ("tiny", "is a bridgetower model: open_clip has no architecture for BridgeTower's cross-modal tower")],
    ids=["siglip", "bridgetower"],
)  # fmt: skip
def test_a_family_open_clip_cannot_load_is_refused_in_one_line(open_clip, synthetic_dataset_dir, tmp_path, capsys,
                                                               preset, says) -> None:  # fmt: skip
    from tests.inference.tiny_models import save_tiny_checkpoint

    run = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "run", preset=preset)
    out = tmp_path / "open_clip"
    capsys.readouterr()  # what making the run printed
    code = main(["export", "--model_name_or_path", str(run), "--output_dir", str(out), "--format", "open_clip"])
    assert code == 2 and not out.exists()  # refused before anything is written
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--format open_clip" in error and says in error, error


def test_without_open_clip_the_format_names_its_extra(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import and find_spec now fail for it
    code = main(["export", "--model_name_or_path", "clip-tiny", "--output_dir", str(tmp_path / "out"), "--format",
                 "open_clip"])  # fmt: skip
    assert code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        "vlfit export: error: --format open_clip needs the open_clip extra (open_clip not installed): "
        "pip install 'vlfit[open_clip]'"
    ]


@pytest.mark.slow
def test_a_metaclip2_run_loads_in_open_clip_with_its_own_tokenizer(open_clip, synthetic_dataset_dir, tmp_path) -> None:
    """MetaCLIP 2 is CLIP's towers pooled at its eos id 2 without CLIP's legacy rule: open_clip pools there too."""
    from tests.inference.tiny_models import save_tiny_checkpoint

    run = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "run", preset="metaclip2-tiny")
    out = tmp_path / "open_clip"
    assert main(["export", "--model_name_or_path", str(run), "--output_dir", str(out), "--format", "open_clip",
                 "--calibration_dataset", synthetic_dataset_dir, "--parity_samples", "4"]) == 0  # fmt: skip
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["text_cfg"]["pool_type"] == "eos"
    captions = ["one red circle", "un cercle rouge", "один красный круг", "一个红色的圆"]
    run_model = vlfit.load(str(run))
    with torch.no_grad():
        theirs = model.encode_text(tokenizer(captions), normalize=True).numpy()
        photo = _photos()["200x600 png"]
        image = model.encode_image(
            preprocess(Image.open(io.BytesIO(photo)).convert("RGB")).unsqueeze(0), normalize=True
        )
    for caption, ours, other in zip(captions, run_model.encode_texts(captions), theirs, strict=True):
        assert _cosine(other, ours) >= 0.9999, caption
    assert _cosine(image[0].numpy(), run_model.encode_images(photo)[0]) >= 0.999
