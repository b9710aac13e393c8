"""Runs that cannot be merged are refused before anything is written, in one line naming the run and what differs:
another family, another vocabulary, another shape, another recorded base, LoRA adapters whose base is not there,
another input spec (normalization mean or std, a NaFlex patch budget)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning

from tests.inference.tiny_models import save_tiny_checkpoint
from tests.merge.runs import changed_run, record_base
from vlfit.errors import ConfigError, ModelLoadError
from vlfit.merging.runs import merge_runs


def _other_family(tiny, data, tmp_path):
    return save_tiny_checkpoint(data, tmp_path / "clip", preset="clip-tiny"), "is a clip model"


def _other_vocabulary(tiny, data, tmp_path):
    run = changed_run(tiny, tmp_path / "vocab")
    tokenizer = json.loads((run / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, two tokens swapped
    (run / "tokenizer.json").write_text(json.dumps(tokenizer))
    return run, "vocabulary"


def _other_shape(tiny, data, tmp_path):
    config = BridgeTowerConfig.from_pretrained(tiny)
    config.text_config.intermediate_size *= 2
    run = tmp_path / "wider"
    BridgeTowerForContrastiveLearning(config).save_pretrained(run)
    for path in tiny.iterdir():
        if not (run / path.name).exists():
            shutil.copy(path, run / path.name)
    return run, "has shape"


def _other_base(tiny, data, tmp_path):
    record_base(changed_run(tiny, tmp_path / "a"), "hub-user/one-base")
    return record_base(changed_run(tiny, tmp_path / "b"), "hub-user/another-base"), "fine-tuned from"


def _unmerged_lora(tiny, data, tmp_path):
    run = changed_run(tiny, tmp_path / "lora")  # its tokenizer and image processor, as a LoRA run saves them
    (run / "model.safetensors").unlink()
    (run / "config.json").unlink()
    adapter_config = {"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "gone")}
    (run / "adapter_config.json").write_text(json.dumps(adapter_config))
    return run, "LoRA run not merged yet"


def _with_image_processor(run, **settings):
    path = run / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return run


def _other_mean(tiny, data, tmp_path):
    run = _with_image_processor(changed_run(tiny, tmp_path / "mean"), image_mean=[0.25, 0.5, 0.75])
    return run, "image_mean [0.25, 0.5, 0.75]"


def _other_std(tiny, data, tmp_path):
    run = _with_image_processor(changed_run(tiny, tmp_path / "std"), image_std=[0.125, 0.25, 0.5])
    return run, "image_std [0.125, 0.25, 0.5]"


def _other_patch_budget(tiny, data, tmp_path):
    first = save_tiny_checkpoint(data, tmp_path / "a", preset="siglip2-tiny")  # 16 patches
    run = _with_image_processor(changed_run(first, tmp_path / "budget"), max_num_patches=32)
    return run, f"max_num_patches 32, {first} with 16"


@pytest.mark.parametrize("make", [_other_family, _other_vocabulary, _other_shape, _other_base, _unmerged_lora,
                                  _other_mean, _other_std, _other_patch_budget])  # fmt: skip
def test_a_run_that_cannot_be_merged_is_refused_in_one_line_naming_it(make, tiny_checkpoint, synthetic_dataset_dir,
                                                                      tmp_path) -> None:  # fmt: skip
    run, what = make(tiny_checkpoint, synthetic_dataset_dir, tmp_path)
    first = tmp_path / "a" if (tmp_path / "a").exists() else tiny_checkpoint
    out = tmp_path / "soup"
    with pytest.raises(ConfigError) as refused:
        merge_runs([str(first), str(run)], method="uniform", output_dir=str(out))
    message = str(refused.value)
    assert "\n" not in message and str(run) in message and what in message, message
    assert not out.exists()


def test_a_run_that_cannot_be_reached_is_named_without_offering_a_flag_merge_has_not(tmp_path) -> None:
    out = tmp_path / "soup"
    with pytest.raises(ModelLoadError) as refused:
        merge_runs(["nobody/no-such-run", "nobody/another"], method="uniform", output_dir=str(out))
    message = str(refused.value)
    assert message.startswith("nobody/no-such-run: cannot load a model config") and "\n" not in message
    assert "--model_preset" not in message and not out.exists()


def test_a_vocabulary_of_the_same_size_is_refused_naming_a_token_that_differs_and_the_caption_length(
    tiny_checkpoint, synthetic_dataset_dir, tmp_path
) -> None:
    run, _ = _other_vocabulary(tiny_checkpoint, synthetic_dataset_dir, tmp_path)
    vocab = json.loads((run / "tokenizer.json").read_text())["model"]["vocab"]
    swapped = sorted(list(vocab)[-2:])[0]
    (run / "input_spec.json").write_text(json.dumps({"format_version": 1, "max_seq_length": 8}))  # the first's: 128
    with pytest.raises(ConfigError) as refused:
        merge_runs([str(tiny_checkpoint), str(run)], method="uniform", output_dir=str(tmp_path / "soup"))
    message = str(refused.value)
    assert f"its tokenizer's vocabulary differs from that of {tiny_checkpoint} (both {len(vocab)} tokens; " in message
    assert f"{swapped!r} is token {vocab[swapped]} in it and " in message and "; 2 tokens differ)" in message
    assert "its caption length differs too (8, 128 there)" in message, message
