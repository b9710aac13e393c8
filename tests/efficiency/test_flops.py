"""FLOPs of a training step: the counter's figure for the tiny preset against a hand count of its matmuls, and
the efficiency arithmetic (TFLOP/s, MFU) the runs report."""

from __future__ import annotations

import pytest
import torch

from vlfit.efficiency.flops import ComputeEfficiency, count_flops
from vlfit.efficiency.peaks import PeakFlops
from vlfit.models.bridgetower import BridgeTowerFamily
from vlfit.models.registry import preset_config


def _encoder_layer(n: int, h: int, i: int) -> int:
    """Forward FLOPs of a transformer layer on n tokens: q, k, v, o projections, attention, feed-forward."""
    return 2 * n * 4 * h * h + 2 * 2 * n * n * h + 2 * 2 * n * h * i


def _cross_layer(n: int, m: int, h: int, i: int) -> int:
    """A BridgeTower cross layer: self-attention on n tokens, cross-attention to m tokens, feed-forward."""
    self_attention = 2 * n * 4 * h * h + 2 * 2 * n * n * h
    cross_attention = 2 * 2 * n * h * h + 2 * 2 * m * h * h + 2 * 2 * n * m * h  # q, o on n; k, v on m; scores
    return self_attention + cross_attention + 2 * 2 * n * h * i


def hand_count_forward(config, batch: int, text_len: int) -> tuple[int, int]:
    """Forward FLOPs of BridgeTowerForContrastiveLearning's matmuls, and those of its patch embedding."""
    text, vision = config.text_config, config.vision_config
    patch = vision.patch_size
    tokens = (vision.image_size // patch) ** 2 + 1
    h, cross_h = vision.hidden_size, config.hidden_size
    patch_embedding = 2 * (tokens - 1) * 3 * patch * patch * h
    flops = text.num_hidden_layers * _encoder_layer(text_len, text.hidden_size, text.intermediate_size)
    flops += vision.num_hidden_layers * _encoder_layer(tokens, h, 4 * h) + patch_embedding
    layers = config.num_hidden_layers
    # Cross layers are built from the text config; the text and image transforms feed each of them, the image
    # transform once more for the contrastive image embedding.
    flops += layers * 2 * text_len * text.hidden_size * cross_h + (layers + 1) * 2 * tokens * h * cross_h
    flops += layers * (
        _cross_layer(text_len, tokens, cross_h, text.intermediate_size)
        + _cross_layer(tokens, text_len, cross_h, text.intermediate_size)
    )
    return batch * flops, batch * patch_embedding


@pytest.mark.slow
def test_a_training_step_of_the_tiny_preset_counts_as_its_matmuls_by_hand() -> None:
    torch.manual_seed(0)
    config = preset_config("tiny")
    family = BridgeTowerFamily()
    model = family.build(config)
    batch, text_len = 4, 12
    size = config.vision_config.image_size
    inputs = {
        "input_ids": torch.randint(5, 500, (batch, text_len)),
        "attention_mask": torch.ones(batch, text_len, dtype=torch.long),
        "pixel_values": torch.randn(batch, 3, size, size),
    }
    forward, patch_embedding = hand_count_forward(config, batch, text_len)
    # Backward costs two matmuls per forward one (inputs' and weights' gradients), except that the pixels need no
    # gradient: the patch embedding's backward is its weight gradient alone.
    expected = 3 * forward - patch_embedding
    loss, counted = count_flops(lambda: family.contrastive_loss(model, inputs).backward())
    assert counted == pytest.approx(expected, rel=0.10)
    _, forward_only = count_flops(lambda: family.contrastive_loss(model, inputs))
    assert forward_only == pytest.approx(forward, rel=0.02)  # attention on the CPU included


def test_efficiency_is_achieved_tflops_over_the_peak_of_every_device() -> None:
    peak = PeakFlops(100.0, "X", "bf16", "data sheet")
    efficiency = ComputeEfficiency(flops_per_sample=2e9, samples_per_second=5000.0, peak=peak, processes=2)
    assert efficiency.achieved_tflops == pytest.approx(10.0)
    assert efficiency.mfu == pytest.approx(0.05)
    metrics = efficiency.metrics("train_")
    assert metrics["train_mfu"] == pytest.approx(0.05) and metrics["train_peak_source"] == "data sheet"
    assert "2.00 GFLOPs per sample" in efficiency.describe() and "5.0% MFU" in efficiency.describe()
    assert "above 100%" not in efficiency.describe()
    # A CPU's peak timed while other work held its cores can be below what the run then achieved: said so.
    disturbed = ComputeEfficiency(2e9, 5000.0, PeakFlops(4.0, "CPU", "fp32", "measured"), processes=2)
    assert "125.0% MFU" in disturbed.describe() and "above 100%: the peak was measured while other work held the " \
        "cores, so this MFU means nothing" in disturbed.describe()  # fmt: skip
