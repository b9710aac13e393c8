"""The train-mode memory estimate and the check that stops a sweep which cannot fit, before anything is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import vlfit.commands.bench
from tests.bench.bench_runs import QUICK, run_bench
from vlfit.bench.fit import GIB, DoesNotFit, available_memory, check_fit, estimate_training_memory
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.registry import family_for_preset

FREEZE_POOLER = {"vision": False, "text": False, "text_pooler": True}


def _estimate(preset: str, batch_size: int, precision: str, freeze: dict[str, bool] | None = None,
              objective: str = "contrastive"):  # fmt: skip
    family = family_for_preset(preset)
    config = family.preset_config(preset)
    return estimate_training_memory(family, config, image_size=family.image_size(config), max_seq_length=128,
                                    batch_size=batch_size, precision=precision, freeze=freeze,
                                    objective=objective)  # fmt: skip


def test_state_comes_from_the_real_parameter_count() -> None:
    family = family_for_preset("tiny")
    model = family.build(family.preset_config("tiny"))
    family.freeze(model, **FREEZE_POOLER)
    estimate = _estimate("tiny", 4, "fp32")
    assert estimate.parameters == sum(p.numel() for p in model.parameters())
    assert estimate.trainable_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # fp32 weights for all; gradient and AdamW's two moments for the trained ones.
    assert estimate.weights == 4 * estimate.parameters
    assert estimate.gradients_and_optimizer == 12 * estimate.trainable_parameters
    frozen = _estimate("tiny", 4, "fp32", freeze={"vision": True, "text": True, "text_pooler": True})
    assert frozen.parameters == estimate.parameters and frozen.trainable_parameters < estimate.trainable_parameters
    assert {tower.name for tower in estimate.towers} == {"text", "vision", "cross-modal"}


def test_activations_grow_with_the_batch_and_halve_under_autocast() -> None:
    small, large = _estimate("small", 8, "fp32"), _estimate("small", 32, "fp32")
    assert large.activations == pytest.approx(4 * small.activations, rel=1e-6)
    assert large.weights == small.weights
    assert _estimate("small", 32, "bf16").activations == pytest.approx(large.activations / 2, rel=1e-6)
    # The large preset at the study's batch: weights, gradients and AdamW states alone are about 13 GiB, and the
    # whole fits in the 80 GB the study trained it on (a floor that refused it would be wrong).
    study = _estimate("large", 48, "bf16")
    assert 860e6 < study.parameters < 870e6
    assert 12 * GIB < study.weights + study.gradients_and_optimizer < 14 * GIB
    assert study.total < 80e9


def test_an_itm_objective_runs_the_cross_modal_tower_on_three_pairs_a_sample() -> None:
    plain, matched = _estimate("small", 8, "bf16"), _estimate("small", 8, "bf16", objective="contrastive+itm")
    cross = next(tower for tower in plain.towers if tower.name == "cross-modal").activation_bytes(8, 2)
    assert matched.activations == pytest.approx(plain.activations + 2 * cross, rel=1e-6)
    assert _estimate("small", 8, "bf16", objective="itm").activations == matched.activations
    assert (matched.weights, matched.gradients_and_optimizer) == (plain.weights, plain.gradients_and_optimizer)


def test_check_names_model_batch_and_estimate_and_suggests_what_to_change() -> None:
    estimate = _estimate("large", 48, "fp32")
    check_fit(estimate, estimate.total, "plenty", model="preset large", batch_size=48, precision="fp32")
    with pytest.raises(DoesNotFit) as raised:
        check_fit(estimate, 40 * GIB, "free memory on a test GPU", model="preset large", batch_size=48,
                  precision="fp32")  # fmt: skip
    message = str(raised.value)
    for text in ("preset large", "batch 48", f"{estimate.total / GIB:.1f} GiB", "free memory on a test GPU is 40.0 GiB",
                 "--per_device_train_batch_size", "--bf16", "--mode loader", "--skip_fit_check"):  # fmt: skip
        assert text in message, text
    suggested = int(message.split("--per_device_train_batch_size ")[1].split()[0])
    fits = _estimate("large", suggested, "fp32")
    assert fits.total <= 40 * GIB < _estimate("large", suggested + 1, "fp32").total


def test_available_memory_is_known_on_this_machine() -> None:
    available, where = available_memory(torch.device("cpu"))
    assert available > 0 and where


def test_a_sweep_that_cannot_fit_stops_before_building_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built = []
    monkeypatch.setattr(vlfit.commands.bench, "available_memory", lambda device: (2**20, "test memory"))
    monkeypatch.setattr(vlfit.commands.bench, "build_model", lambda *args: built.append(args))
    code, results, _ = run_bench(tmp_path, *QUICK, "--mode", "loader,train", "--workers", "0")
    assert code == 2 and results is None and not built
    error = capsys.readouterr().err
    assert "vlfit bench: train mode with preset tiny at batch 4 (fp32) does not fit" in error
    assert "test memory is 0.0 GiB" in error and "--mode loader" in error


@pytest.mark.slow
def test_skip_fit_check_runs_anyway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("the fit check ran")

    monkeypatch.setattr(vlfit.commands.bench, "check_fit", refuse)
    code, results, _ = run_bench(tmp_path, *QUICK, "--workers", "0", "--skip_fit_check")
    assert code == 0 and results["rows"][0]["mode"] == "train" and results["rows"][0]["samples_per_second"] > 0
    assert "estimated_train_memory_gib" not in results["settings"]


def test_the_estimate_builds_nothing_but_a_meta_model(monkeypatch: pytest.MonkeyPatch) -> None:
    build = BridgeTowerFamily.build
    devices = []

    def record(self: BridgeTowerFamily, config: Any) -> torch.nn.Module:
        model = build(self, config)
        devices.append({p.device.type for p in model.parameters()})
        return model

    monkeypatch.setattr(BridgeTowerFamily, "build", record)
    _estimate("large", 48, "bf16")
    assert devices == [{"meta"}]
