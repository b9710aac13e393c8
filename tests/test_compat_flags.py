"""run_bridgetower.py command lines parse unchanged, and each of its flags vlfit does not use gets one log line."""

import json
import logging
import shlex

import pytest

from tests.checkpoints import save_tiny_checkpoint
from vlfit.commands.train import note_compat_flags, parse_arguments
from vlfit.compat_flags import FLAG_NOTES, compat_notes

# optimum-habana examples/contrastive-image-text/README.md, "BridgeTower": the flags after run_bridgetower.py, with
# MODEL and DATA in place of the hub ids (BridgeTower/bridgetower-large-itm-mlm-itc and
# jmhessel/newyorker_caption_contest) and OUT in place of /tmp/bridgetower-test.
README_COMMAND = """
  --output_dir OUT
  --model_name_or_path MODEL
  --dataset_name DATA --dataset_config_name matching
  --image_column image --caption_column image_description
  --remove_unused_columns=False
  --do_train --do_eval --do_predict
  --per_device_train_batch_size="40" --per_device_eval_batch_size="16"
  --num_train_epochs 5
  --learning_rate="1e-5"
  --overwrite_output_dir
  --save_strategy no
  --use_habana --use_lazy_mode --use_hpu_graphs_for_inference --gaudi_config_name Habana/clip
  --throughput_warmup_steps 3
  --logging_steps 10
  --dataloader_num_workers 1
  --sdp_on_bf16
"""
README_GAUDI_FLAGS = [
    "use_habana",
    "use_lazy_mode",
    "use_hpu_graphs_for_inference",
    "gaudi_config_name",
    "throughput_warmup_steps",
    "sdp_on_bf16",
]
# Flags earlier versions of that README used (2024), and optimum-habana's CI adds (--trust_remote_code True).
OLDER_README_FLAGS = """
  --dataset_revision 3c6c4f6c0ff7e902833d3afa5f8f3875c2b036e6
  --mediapipe_dataloader
  --distribution_strategy fast_ddp
  --trust_remote_code True
"""


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A tiny BridgeTower saved with save_pretrained, standing in for the hub checkpoint."""
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-checkpoint")))


def _readme_argv(command: str, checkpoint: str, data: str, out: str) -> list[str]:
    text = command.replace("MODEL", checkpoint).replace("DATA", data).replace("OUT", out)
    return shlex.split(text)  # as a shell would split it: --per_device_train_batch_size="40" -> ...=40


def _compat_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vlfit.compat_flags"]


def test_readme_command_parses_and_each_gaudi_flag_gets_one_line(
    tiny_checkpoint, synthetic_dataset_dir, tmp_path, caplog
):
    argv = _readme_argv(README_COMMAND, tiny_checkpoint, synthetic_dataset_dir, str(tmp_path / "out"))
    args = parse_arguments(argv)
    assert args.model.model_name_or_path == tiny_checkpoint
    assert args.data.dataset_name == synthetic_dataset_dir
    assert args.data.caption_column == "image_description"
    assert args.training.per_device_train_batch_size == 40 and args.training.learning_rate == 1e-5
    assert args.training.throughput_warmup_steps == 3
    assert args.training.use_habana and args.training.gaudi_config_name == "Habana/clip"
    assert args.training.remove_unused_columns is False

    caplog.set_level(logging.INFO, logger="vlfit")
    lines = note_compat_flags(args)
    assert _compat_lines(caplog) == lines
    for name in README_GAUDI_FLAGS:
        naming = [line for line in lines if line.startswith(f"--{name}")]
        assert len(naming) == 1, (name, lines)
    assert len(lines) == len(README_GAUDI_FLAGS)  # nothing about flags vlfit uses as they are
    assert "--use_habana: ignored: vlfit runs on NVIDIA GPUs or the CPU, not on Gaudi HPUs" in lines
    assert "--gaudi_config_name Habana/clip: ignored" in "\n".join(lines)
    assert "--throughput_warmup_steps 3: the first 3 training steps are left out of the reported samples/s" in (
        "\n".join(lines)
    )


def test_older_readme_flags_parse_and_mediapipe_turns_on_device_decode(
    tiny_checkpoint, synthetic_dataset_dir, tmp_path, caplog
):
    argv = _readme_argv(README_COMMAND + OLDER_README_FLAGS, tiny_checkpoint, synthetic_dataset_dir, str(tmp_path))
    args = parse_arguments(argv)
    assert args.data.mediapipe_dataloader and args.data.decode_on_device
    assert args.model.trust_remote_code is True
    assert args.training.distribution_strategy == "fast_ddp"
    caplog.set_level(logging.INFO, logger="vlfit")
    lines = note_compat_flags(args)
    for name in ("mediapipe_dataloader", "distribution_strategy", "trust_remote_code"):
        assert len([line for line in lines if line.startswith(f"--{name}")]) == 1, (name, lines)
    assert "--mediapipe_dataloader: mapped to --decode_on_device: JPEGs are decoded on the GPU with nvJPEG" in (
        "\n".join(lines)
    )
    assert not any(line.startswith("--dataset_revision") for line in lines)  # a flag vlfit uses as it is


def test_model_loading_flags_have_run_bridgetowers_defaults(tmp_path):
    args = parse_arguments(["--model_preset", "tiny", "--output_dir", str(tmp_path)])
    assert args.model.config_name is None
    assert args.model.use_fast_tokenizer is True
    assert args.model.trust_remote_code is False
    assert compat_notes(args.given, *args[:4]) == []  # nothing given, nothing to say
    args = parse_arguments(
        ["--model_preset", "tiny", "--output_dir", str(tmp_path), "--config_name", "cfg", "--no_use_fast_tokenizer"]
    )
    assert args.model.config_name == "cfg" and args.model.use_fast_tokenizer is False
    lines = [line for _, line in compat_notes(args.given, *args[:4])]
    assert lines == [
        "--config_name cfg: passed to model loading: the model config is read from cfg instead of --model_name_or_path",
        "--use_fast_tokenizer False: passed to model loading; transformers 5 always loads the fast (tokenizers) "
        "tokenizer",
    ]


@pytest.mark.parametrize(
    "flags",
    [["--use_lazy_mode"], ["--use_lazy_mode", "False"], ["--no_use_lazy_mode"], ["--use_lazy_mode=false"]],
    ids=["bare", "false", "no_", "equals"],
)
def test_a_flag_given_at_its_default_value_is_still_noted(tmp_path, flags):
    # use_lazy_mode defaults to True, as in optimum-habana: a note must not depend on the value differing.
    args = parse_arguments(["--model_preset", "tiny", "--output_dir", str(tmp_path), *flags])
    notes = compat_notes(args.given, *args[:4])
    assert len(notes) == 1 and notes[0][1].startswith("--use_lazy_mode")
    assert notes[0][0] == logging.WARNING


def test_flags_file_notes_the_keys_it_sets(tmp_path):
    path = tmp_path / "flags.json"
    flags = {"model_preset": "tiny", "output_dir": str(tmp_path), "use_habana": True, "overwrite_cache": False}
    path.write_text(json.dumps(flags))
    args = parse_arguments([str(path)])
    lines = [line for _, line in compat_notes(args.given, *args[:4])]
    assert [line.split(":")[0] for line in lines] == ["--use_habana", "--overwrite_cache False"]


def test_every_note_names_a_parsed_field(tmp_path):
    args = parse_arguments(["--model_preset", "tiny", "--output_dir", str(tmp_path)])
    for name in FLAG_NOTES:
        assert any(hasattr(group, name) for group in args[:4]), name
