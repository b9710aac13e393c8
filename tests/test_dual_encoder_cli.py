"""CLIP and SigLIP through the real CLI: a run_clip.py command line trains a CLIP checkpoint that ``vlfit eval``
loads; a SigLIP preset trains, evaluates and exports (its fixed-length text padding inside the graph)."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.checkpoints import CAPTIONS, save_bundle
from vlfit.cli import main
from vlfit.models.loading import load_model

pytestmark = pytest.mark.slow

# transformers examples/pytorch/contrastive-image-text/README.md: the flags after run_clip.py, with MODEL, DATA and
# OUT in place of ./clip-roberta, ydshieh/coco_dataset_script and ./clip-roberta-finetuned, and this dataset's
# caption column.
RUN_CLIP_COMMAND = """
  --output_dir OUT --model_name_or_path MODEL --dataset_name DATA
  --image_column image --caption_column image_description
  --remove_unused_columns=False --do_train --do_eval
  --per_device_train_batch_size="8" --per_device_eval_batch_size="8"
  --learning_rate="5e-5" --warmup_steps="0" --weight_decay 0.1
  --overwrite_output_dir --freeze_vision_model --max_seq_length 128
"""


def test_a_run_clip_command_line_fine_tunes_a_clip_checkpoint(tmp_path, synthetic_dataset_dir):
    bundle = load_model(model_preset="clip-tiny", captions=lambda: CAPTIONS)
    model = save_bundle(bundle, str(tmp_path / "clip"))
    out = tmp_path / "out"
    argv = shlex.split(
        RUN_CLIP_COMMAND.replace("MODEL", model).replace("DATA", synthetic_dataset_dir).replace("OUT", str(out))
    )
    assert main(["train", *argv, "--max_steps", "3", "--save_strategy", "no", "--report_to", "none"]) == 0

    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    results = json.loads((out / "eval_results.json").read_text())
    assert 0.0 <= results["eval_t2i_recall@1"] <= 1.0
    # --freeze_vision_model, as run_clip.py means it: the image tower did not move; its projection and the text
    # tower did.
    tuned = load_model(model_name_or_path=str(out)).model.state_dict()
    start = bundle.model.state_dict()
    assert all((tuned[k] == start[k]).all() for k in start if k.startswith("vision_model."))
    for moved in ("visual_projection.weight", "text_projection.weight"):
        assert not (tuned[moved] == start[moved]).all(), moved

    assert main(["eval", "--model_name_or_path", str(out), "--dataset_name", synthetic_dataset_dir,
                 "--eval_split", "test", "--report_to", "none"]) == 0  # fmt: skip
    assert json.loads((out / "eval_results.json").read_text())["eval_num_samples"] > 0


@pytest.mark.parametrize("preset", ["siglip-tiny"])
def test_a_siglip_preset_trains_evaluates_and_exports(preset, tmp_path, synthetic_dataset_dir):
    out = tmp_path / "model"
    assert main(["train", "--model_preset", preset, "--dataset_name", synthetic_dataset_dir, "--output_dir",
                 str(out), "--max_steps", "3", "--per_device_train_batch_size", "8", "--do_eval",
                 "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]) == 0  # fmt: skip
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert losses and all(loss == loss and loss > 0 for loss in losses)
    assert json.loads((out / "config.json").read_text())["model_type"] == "siglip"
    # The export refuses a graph whose embeddings differ from PyTorch's (cosine < 0.9999) on these samples.
    exported = tmp_path / "onnx"
    assert main(["export", "--model_name_or_path", str(out), "--output_dir", str(exported), "--parity_samples",
                 "9", "--calibration_dataset", synthetic_dataset_dir]) == 0  # fmt: skip
    manifest = json.loads((exported / "export_manifest.json").read_text())
    assert manifest["identity"]["family"] == "siglip" and manifest["text"]["max_seq_length"] == 64
    assert manifest["parity"]["fp32"]["text"]["min_cosine"] >= 0.9999


def test_a_checkpoint_without_its_tokenizer_stops_in_one_line_and_writes_nothing(tmp_path, synthetic_dataset_dir,
                                                                                 capsys):  # fmt: skip
    bundle = load_model(model_preset="siglip-tiny", captions=lambda: CAPTIONS)
    bundle.model.save_pretrained(tmp_path / "model")
    bundle.image_processor.save_pretrained(tmp_path / "model")  # no tokenizer files
    out = tmp_path / "out"
    assert main(["train", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", synthetic_dataset_dir,
                 "--output_dir", str(out), "--max_steps", "1", "--report_to", "none"]) == 2  # fmt: skip
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("vlfit train: error:")]
    assert len(lines) == 1 and "cannot load its tokenizer" in lines[0] and "--tokenizer_name" in lines[0], lines
    assert not out.exists()
