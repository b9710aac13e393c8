"""``vlfit export --format immich``: the folder is loaded as Immich's machine-learning service loads a CLIP model
(only the folder, with onnxruntime and the tokenizers library, its preprocessing and tokenization rewritten here
from immich_ml/models/clip and transforms.py) and embeds photos and captions as vlfit embeds them, for CLIP, SigLIP
and BridgeTower; the run's own caption length and image settings are the folder's."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vlfit
from vlfit.atomic_files import STAGING_NAME
from vlfit.cli import main
from vlfit.inference.runtime_settings import RuntimeSettings
from vlfit.models.input_spec_file import read_input_settings, save_input_settings

pytestmark = pytest.mark.slow  # each export traces two graphs

CAPTIONS = ["one red circle", "two blue squares and a green cross", "a yellow triangle above three circles"]
SHORT_CAPTIONS = 16  # the caption length the CLIP run below was trained at (its input_spec.json)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, synthetic_dataset_dir, tmp_path_factory) -> dict[str, Path]:
    """Runs of each family: BridgeTower (``tiny``), SigLIP, and CLIP trained at 16-token captions whose tokenizer
    pads with its end-of-text token (as OpenAI's CLIP tokenizer does)."""
    from transformers import AutoTokenizer

    from tests.inference.tiny_models import save_tiny_checkpoint
    from vlfit.inference.runtime import ModelRuntime

    folder = tmp_path_factory.mktemp("immich-runs")
    clip = save_tiny_checkpoint(synthetic_dataset_dir, folder / "clip", preset="clip-tiny")
    tokenizer = AutoTokenizer.from_pretrained(clip)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(clip)
    spec = ModelRuntime.open(str(clip), RuntimeSettings(backend="torch", max_seq_length=SHORT_CAPTIONS)).encoder.spec
    save_input_settings(spec, str(clip))  # as vlfit train --max_seq_length 16 records it
    siglip = save_tiny_checkpoint(synthetic_dataset_dir, folder / "siglip", preset="siglip-tiny")
    return {"clip": clip, "siglip": siglip, "bridgetower": tiny_checkpoint}


@pytest.fixture(scope="module")
def exports(checkpoints, synthetic_dataset_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("immich")
    for family, checkpoint in checkpoints.items():
        assert main(["export", "--model_name_or_path", str(checkpoint), "--output_dir", str(out / family),
                     "--format", "immich", "--calibration_dataset", synthetic_dataset_dir, "--parity_samples",
                     "8"]) == 0  # fmt: skip
    return {family: out / family for family in checkpoints}


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    """A photo (matplotlib's sample, 512x600 JPEG) and two crops of it: landscape JPEG and tall PNG."""
    import matplotlib.cbook

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        portrait = f.read()
    picture = Image.open(io.BytesIO(portrait)).convert("RGB")

    def encoded(image: Image.Image, fmt: str) -> bytes:
        out = io.BytesIO()
        image.save(out, fmt)
        return out.getvalue()

    return {"512x600 jpeg": portrait, "512x300 jpeg": encoded(picture.crop((0, 100, 512, 400)), "JPEG"),
            "200x600 png": encoded(picture.crop((150, 0, 350, 600)), "PNG")}  # fmt: skip


class ImmichClip:
    """A CLIP model as Immich's OpenClipTextualEncoder and OpenClipVisualEncoder load and run it from a folder."""

    def __init__(self, folder: Path) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.config = json.loads((folder / "config.json").read_text())
        self.preprocess = json.loads((folder / "visual" / "preprocess_cfg.json").read_text())
        pad_token = json.loads((folder / "textual" / "tokenizer_config.json").read_text())["pad_token"]
        context = self.config["text_cfg"].get("context_length", 77)
        self.tokenizer = Tokenizer.from_file(str(folder / "textual" / "tokenizer.json"))
        self.tokenizer.enable_padding(length=context, pad_token=pad_token, pad_id=self.tokenizer.token_to_id(pad_token))
        self.tokenizer.enable_truncation(max_length=context)
        self.textual = ort.InferenceSession(str(folder / "textual" / "model.onnx"), providers=["CPUExecutionProvider"])
        self.visual = ort.InferenceSession(str(folder / "visual" / "model.onnx"), providers=["CPUExecutionProvider"])

    def text(self, caption: str) -> np.ndarray:
        ids = self.tokenizer.encode(" ".join(caption.split())).ids
        return self.textual.run(None, {"text": np.array([ids], dtype=np.int32)})[0][0]

    def image(self, data: bytes) -> np.ndarray:
        picture = Image.open(io.BytesIO(data))
        picture.load()
        picture = picture.convert("RGB")
        size = self.preprocess["size"]
        size = size[0] if isinstance(size, list) else size
        resample = {r.name.lower(): r for r in Image.Resampling}[self.preprocess["interpolation"]]
        assert self.preprocess.get("resize_mode", "shortest") == "shortest"
        width, height = picture.size  # resize_pil, then crop_pil
        if width < height:
            picture = picture.resize((size, int((height / width) * size)), resample=resample)
        else:
            picture = picture.resize((int((width / height) * size), size), resample=resample)
        left, upper = int(picture.size[0] / 2 - size / 2), int(picture.size[1] / 2 - size / 2)
        picture = picture.crop((left, upper, left + size, upper + size))
        pixels = np.asarray(picture, dtype=np.float32) / 255.0
        pixels *= 1.0 / np.array(self.preprocess["std"], dtype=np.float32)
        pixels -= np.array(self.preprocess["mean"], dtype=np.float32) / np.array(self.preprocess["std"], np.float32)
        return self.visual.run(None, {"image": np.expand_dims(pixels.transpose(2, 0, 1), 0)})[0][0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("family", ["clip", "siglip", "bridgetower"])
def test_immich_embeds_photos_and_captions_as_vlfit_does(exports, checkpoints, photos, family) -> None:
    immich = ImmichClip(exports[family])
    model = vlfit.load(str(checkpoints[family]))
    for name, photo in photos.items():
        cosine = _cosine(immich.image(photo), model.encode_images(photo)[0])
        # a PNG is decoded alike: Immich's resize and crop must land on vlfit's pixels; a JPEG vlfit decodes at a
        # reduced DCT scale
        assert cosine >= (0.99999 if name.endswith("png") else 0.999), f"{family} {name}: {cosine}"
    for caption, expected in zip(CAPTIONS, model.encode_texts(CAPTIONS), strict=True):
        assert _cosine(immich.text(caption), expected) >= 0.9999, (family, caption)
    record = json.loads((exports[family] / "vlfit_export.json").read_text())
    assert record["parity"]["text"]["min_cosine"] >= 0.9999 and record["format"] == "immich"


def test_the_folder_has_immichs_layout_and_the_runs_inputs(exports, checkpoints) -> None:
    import onnxruntime as ort

    for family, folder in exports.items():
        runtime = vlfit.load(str(checkpoints[family])).runtime
        spec, size = runtime.encoder.spec, runtime.image_size
        config = json.loads((folder / "config.json").read_text())
        assert config["embed_dim"] == runtime.encoder.identity.embedding_size
        assert config["text_cfg"]["context_length"] == spec.max_seq_length
        assert config["vision_cfg"]["image_size"] == size
        textual = ort.InferenceSession(str(folder / "textual" / "model.onnx"), providers=["CPUExecutionProvider"])
        visual = ort.InferenceSession(str(folder / "visual" / "model.onnx"), providers=["CPUExecutionProvider"])
        (text,), (image,) = textual.get_inputs(), visual.get_inputs()
        assert (text.name, text.type, text.shape) == ("text", "tensor(int32)", [1, spec.max_seq_length])
        assert (image.name, image.type, image.shape) == ("image", "tensor(float)", [1, 3, size, size])
        for session in (textual, visual):
            (output,) = session.get_outputs()
            assert (output.name, output.shape) == ("embedding", [1, config["embed_dim"]])
        preprocess = json.loads((folder / "visual" / "preprocess_cfg.json").read_text())
        assert preprocess["size"] == [size, size] and preprocess["resize_mode"] == "shortest"
        assert preprocess["interpolation"] == "bicubic"
        assert preprocess["mean"] == pytest.approx(list(spec.image_mean))
        assert preprocess["std"] == pytest.approx(list(spec.image_std))
        tokenizer = json.loads((folder / "textual" / "tokenizer_config.json").read_text())
        assert tokenizer["pad_token"] == spec.tokenizer.pad_token
        assert not (folder / STAGING_NAME).exists()
    # the CLIP run's recorded 16 tokens, not the 77 its text tower has room for
    assert read_input_settings(str(checkpoints["clip"]))["max_seq_length"] == SHORT_CAPTIONS
    assert json.loads((exports["clip"] / "config.json").read_text())["text_cfg"]["context_length"] == SHORT_CAPTIONS


def test_a_caption_longer_than_the_context_is_cut_where_vlfit_cuts_it(exports, checkpoints) -> None:
    caption = " ".join(["one red circle and"] * 10) + " a cross"  # far over 16 tokens
    immich = ImmichClip(exports["clip"])
    assert _cosine(immich.text(caption), vlfit.load(str(checkpoints["clip"])).encode_texts([caption])[0]) >= 0.9999


@pytest.mark.parametrize(
    ("run", "flags", "says"),
    [("siglip", ["--quantize", "int8"], "leave --quantize out"),
     ("naflex", [], "NaFlex, max_num_patches 16), and Immich feeds square images")],
    ids=["int8", "siglip2-naflex"],
)  # fmt: skip
def test_what_immich_cannot_load_is_refused_in_one_line(checkpoints, synthetic_dataset_dir, tmp_path, capsys, run,
                                                         flags, says) -> None:  # fmt: skip
    from tests.inference.tiny_models import save_tiny_checkpoint

    if run == "naflex":  # SigLIP 2 at its images' own aspect ratios
        checkpoint = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "naflex", preset="siglip2-tiny")
    else:
        checkpoint = checkpoints[run]
    out = tmp_path / "immich"
    capsys.readouterr()  # what making the run printed
    code = main(["export", "--model_name_or_path", str(checkpoint), "--output_dir", str(out), "--format", "immich",
                 *flags])  # fmt: skip
    assert code == 2 and not out.exists()  # refused before anything is written
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--format immich" in error and says in error


def test_the_resize_check_refuses_the_image_geometry_immich_has_no_resize_for(tiny_checkpoint, synthetic_dataset_dir,
                                                                           tmp_path) -> None:  # fmt: skip
    """The check reads the model's own image geometry (input_spec.json's resize, crop and resample): NaFlex's patch
    grid (patch_budget, uncropped, bilinear) has no open_clip resize_mode and is refused, naming it; the square one is
    Immich's shortest-side bicubic resize."""
    from tests.inference.tiny_models import save_tiny_checkpoint
    from vlfit.inference.export_immich import immich_refusal, preprocess_config
    from vlfit.inference.runtime import ModelRuntime

    naflex = save_tiny_checkpoint(synthetic_dataset_dir, tmp_path / "naflex", preset="siglip2-tiny")
    refusal = immich_refusal(ModelRuntime.open(str(naflex)).encoder)
    assert refusal is not None and "patch_budget/none/bilinear" in refusal, refusal
    square = ModelRuntime.open(str(tiny_checkpoint)).encoder
    assert immich_refusal(square) is None
    assert (preprocess_config(square)["resize_mode"], preprocess_config(square)["interpolation"]) == (
        "shortest", "bicubic")  # fmt: skip


def test_an_export_replaces_the_folder_it_wrote_before(exports, checkpoints, synthetic_dataset_dir, tmp_path) -> None:
    out = tmp_path / "again"
    shutil.copytree(exports["siglip"], out)
    (out / "textual" / "model.onnx").write_bytes(b"stale")
    assert main(["export", "--model_name_or_path", str(checkpoints["siglip"]), "--output_dir", str(out), "--format",
                 "immich", "--calibration_dataset", synthetic_dataset_dir, "--parity_samples", "4"]) == 0  # fmt: skip
    assert ImmichClip(out).text("one red circle").shape == (json.loads((out / "config.json").read_text())["embed_dim"],)
