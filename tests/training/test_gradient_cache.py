"""Gradient caching equals the plain batch: loss and every parameter's gradient (fp32, within 1e-5 relative) for
every family, hard negatives included; with 2 gloo processes and global negatives through DDP, equal to one process
on the concatenated batch; dropout draws the same masks in both passes; the Trainer flag trains the same steps."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.models.test_dual_encoders import _inputs
from tests.training.train_runs import single_torch_thread
from vlfit.cli import main
from vlfit.models import bridgetower, clip, siglip
from vlfit.models.family import LossEmbeddings, LossScope
from vlfit.training.gradient_cache import gradient_cached_backward

FAMILIES = {
    "tiny": bridgetower.BridgeTowerFamily(),
    "clip-tiny": clip.CLIPFamily(),
    "siglip-tiny": siglip.SiglipFamily(),
}


def _model(preset: str, state_dict: dict | None = None, train: bool = False) -> torch.nn.Module:
    family = FAMILIES[preset]
    torch.manual_seed(0)
    model = family.build(family.preset_config(preset))
    family.initialize_preset(model, preset)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    family.prepare_for_training(model)
    return model.train(train)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_equal_gradients(grads: dict, reference: dict, msg: str) -> None:
    assert grads.keys() == reference.keys(), msg
    for name, grad in grads.items():
        # 1e-5 relative; the floor is for entries that are zero but for rounding (attention key biases: softmax
        # cancels them), where float32 sums taken in another order leave ~1e-8.
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-6, msg=f"{msg} {name}")


def _plain(preset: str, model: torch.nn.Module, inputs: dict, global_negatives: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = FAMILIES[preset].contrastive_loss(
        model, inputs, LossScope(global_negatives=global_negatives, symmetric=True)
    )
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("batch", ["plain", "hard negatives", "same images"])
def test_chunks_give_the_whole_batchs_loss_and_gradients(preset, batch):
    # "same images": rows 0 and 3 (one chunk) and 1 and 5 (two chunks) show one image each.
    model, inputs = (
        _model(preset),
        _inputs(hard_negatives=batch == "hard negatives", same_images=batch == "same images"),
    )
    reference_loss, reference_grads = _plain(preset, model, inputs, global_negatives=True)
    model.zero_grad(set_to_none=True)
    # Chunks of 4 and 2: uneven on purpose.
    loss = gradient_cached_backward(
        FAMILIES[preset], model, inputs, 4, scope=LossScope(global_negatives=True, symmetric=True)
    )
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=0)
    _assert_equal_gradients(_grads(model), reference_grads, preset)


def test_dropout_draws_the_same_masks_in_both_passes():
    family, model, inputs = FAMILIES["tiny"], _model("tiny", train=True), _inputs()  # tiny: dropout 0.1
    passes: list[torch.Tensor] = []
    loss_embeddings = family.loss_embeddings

    def recording(model: torch.nn.Module, chunk: dict) -> LossEmbeddings:
        embeddings = loss_embeddings(model, chunk)
        passes.append(embeddings.rows["cross"].detach().clone())
        return embeddings

    family_spy = bridgetower.BridgeTowerFamily()
    family_spy.loss_embeddings = recording  # type: ignore[method-assign]
    gradient_cached_backward(family_spy, model, inputs, 3)
    first, second = passes[:2], passes[2:]
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Dropout is on: another draw differs, so the equality above can fail.
    assert not torch.equal(family.loss_embeddings(model, inputs).rows["cross"][:3].detach(), first[0])


def two_process_payload() -> dict:
    """What both processes of the 2-process check read (``tests.two_processes``): hard negatives, and rows of one
    image on both processes (rows 1 and 5: SAME_IMAGES)."""
    return {"state_dict": _model("tiny").state_dict(), "inputs": _inputs(hard_negatives=True, same_images=True)}


def two_process_worker(rank: int, world: int, init_file: str, payload_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        payload = torch.load(payload_path)
        model = _model("tiny", payload["state_dict"])
        ddp = DistributedDataParallel(model, find_unused_parameters=True)  # as the Trainer wraps it
        rows = {key: value[[0, 4][rank] : [4, 6][rank]] for key, value in payload["inputs"].items()}
        loss = gradient_cached_backward(
            FAMILIES["tiny"], ddp, rows, 2, scope=LossScope(global_negatives=True, symmetric=True), no_sync=ddp.no_sync
        )
        torch.save({"loss": loss, "grads": _grads(model)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_with_global_negatives_equal_one_process_on_the_whole_batch(two_process_results):
    model, inputs = _model("tiny"), _inputs(hard_negatives=True, same_images=True)
    ranks = two_process_results[__name__]
    reference_loss, reference_grads = _plain("tiny", model, inputs, global_negatives=False)
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, reference_loss, rtol=1e-5, atol=0)
    for rank in ranks:  # DDP averaged the gradients once, after the last chunk
        _assert_equal_gradients(rank["grads"], reference_grads, "ddp")


@pytest.mark.slow
def test_the_flag_trains_the_steps_a_plain_batch_trains(tmp_path, synthetic_dataset_dir):
    def losses(out: str, *extra: str) -> dict[int, float]:
        assert main(["train", "--model_preset", "clip-tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                     out, "--max_steps", "3", "--per_device_train_batch_size", "12", "--logging_steps", "1",
                     "--save_strategy", "no", "--report_to", "none", "--seed", "0", *extra]) == 0  # fmt: skip
        with open(os.path.join(out, "trainer_state.json")) as f:
            history = json.load(f)["log_history"]
        return {h["step"]: h["loss"] for h in history if "loss" in h}

    with single_torch_thread():  # clip-tiny has no dropout: the runs compute the same function
        plain = losses(str(tmp_path / "plain"))
        cached = losses(str(tmp_path / "cached"), "--gradient_cache_chunk_size", "5")
    assert plain.keys() == cached.keys() == {1, 2, 3}
    for step, loss in plain.items():
        assert cached[step] == pytest.approx(loss, rel=1e-4), step


def test_gradient_accumulation_with_caching_is_refused(tmp_path, synthetic_dataset_dir, capsys):
    assert main(["train", "--model_preset", "tiny", "--dataset_name", synthetic_dataset_dir, "--output_dir",
                 str(tmp_path), "--gradient_cache_chunk_size", "4",
                 "--gradient_accumulation_steps", "2"]) == 2  # fmt: skip
    assert "--gradient_cache_chunk_size with --gradient_accumulation_steps > 1" in capsys.readouterr().err
