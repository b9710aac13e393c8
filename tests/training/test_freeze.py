"""``--freeze text|vision|cross`` and ``--unfreeze_after_steps``: a frozen tower does not move until the step named,
then trains; a tower the family lacks, or an unfreeze with nothing frozen, stops with one line."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from tests.training.train_runs import single_torch_thread
from vlfit.cli import main
from vlfit.commands.train import parse_arguments
from vlfit.training.run import run


class RecordWeights(TrainerCallback):
    """The named parameters' values after every optimizer step."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.values: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        params = dict(model.named_parameters())
        self.values[state.global_step] = {name: params[name].detach().clone() for name in self.names}


def test_frozen_towers_stay_until_unfrozen_then_train(tmp_path, synthetic_dataset_dir):
    vision = "bridgetower.vision_model.visual.transformer.resblocks.0.mlp.c_fc.weight"
    cross = "bridgetower.cross_modal_text_layers.0.output.dense.weight"
    text = "bridgetower.text_model.encoder.layer.0.output.dense.weight"
    args = parse_arguments(["--model_preset", "tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                            str(tmp_path), "--freeze", "vision,cross", "--unfreeze_after_steps", "2",
                            "--max_steps", "4", "--per_device_train_batch_size", "8", "--learning_rate", "1e-3",
                            "--save_strategy", "no", "--report_to", "none", "--do_train"])  # fmt: skip
    recorder = RecordWeights([vision, cross, text])
    with single_torch_thread():
        run(args.model, args.data, args.training, callbacks=[recorder])
    steps = recorder.values
    assert sorted(steps) == [1, 2, 3, 4]
    for name in (vision, cross):
        assert torch.equal(steps[1][name], steps[2][name]), name  # frozen for the first 2 steps
        assert not torch.equal(steps[2][name], steps[3][name]), name  # then trained
    assert not torch.equal(steps[1][text], steps[2][text])  # never frozen


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model_preset", "clip-tiny", "--freeze", "cross"], "--freeze cross: a clip model has no cross tower"),
        (["--model_preset", "tiny", "--freeze", "audio"], "--freeze audio: unknown tower"),
        (["--model_preset", "tiny", "--unfreeze_after_steps", "3"], "--unfreeze_after_steps needs a frozen tower"),
    ],
)
def test_bad_freeze_flags_stop_in_one_line(flags, message, tmp_path, synthetic_dataset_dir, capsys):
    assert main(["train", *flags, "--dataset_name", synthetic_dataset_dir, "--output_dir", str(tmp_path),
                 "--max_steps", "1", "--report_to", "none"]) == 2  # fmt: skip
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
