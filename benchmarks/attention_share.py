"""How much of a BridgeTower training step is eager attention, and what the fused (sdpa) path gives back.

Two readings of one preset (default ``large``, BridgeTower-large's shapes, random init):

- FLOPs (device-independent): one eager training step counted by ``FlopCounterMode``, split into the attention
  products (scores ``QK^T`` and ``scores @ V``) of the text and cross-modal layers, which transformers runs
  eagerly for BridgeTower, and those of the vision tower (``nn.MultiheadAttention``: fused already); the rest is
  projections, MLPs and heads.
- Time, on this machine: training steps (``vlfit bench``'s ``TrainStep``: forward, backward, clipping, fused
  AdamW) on one fixed batch with
  ``--attn_implementation eager`` and ``sdpa`` alternately, medians over ``--repeats`` pairs; the eager share of
  step time is at least ``1 - sdpa/eager`` (what fusing saved) and the fused kernel still costs something.

    python benchmarks/attention_share.py [--preset large] [--batch_size 2] [--text_length 40] [--repeats 3]
        [--device cpu|cuda] [--bf16] [--output FILE.json]

On 2 CPU cores a ``large`` step at batch 1 took 15 to 19 s, and ``--batch_size 1 --repeats 2`` about 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BridgeTowerForContrastiveLearning

import vlfit.efficiency.flops  # noqa: F401  (registers the FLOP formula of the CPU SDPA kernel)
from vlfit.bench.measure import TrainStep, synchronize
from vlfit.data.batch import Batch
from vlfit.models.bridgetower import BridgeTowerFamily, set_attention_implementation
from vlfit.models.presets import get_preset, list_presets
from vlfit.models.registry import preset_config

BRIDGETOWER_PRESETS = [name for name in list_presets() if get_preset(name).family == "bridgetower"]


def batch(preset: str, batch_size: int, text_length: int, device: torch.device) -> Batch:
    """One model-ready batch of random captions and normalized pixels."""
    size = preset_config(preset).vision_config.image_size
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(5, 1000, (batch_size, text_length), generator=generator),
        "attention_mask": torch.ones(batch_size, text_length, dtype=torch.long),
        "pixel_values": torch.randn(batch_size, 3, size, size, generator=generator),
    }
    ids = [str(i) for i in range(batch_size)]
    return Batch({key: value.to(device) for key, value in inputs.items()}, ids, list(range(batch_size)), on_device=True)


def flop_shares(model: BridgeTowerForContrastiveLearning, step: Any, batch_size: int) -> dict[str, Any]:
    """FLOPs of one eager training ``step`` of ``model`` by kind of operation.

    With eager text/cross-modal attention, batched matmuls (``bmm``) are exactly its score and value products:
    every projection is an ``mm``/``addmm``, and the vision tower's attention is one fused SDPA call (counted by
    the formula ``vlfit.efficiency.flops`` registers for the CPU kernel).
    """
    set_attention_implementation(model, "eager")
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    total = counter.get_total_flops()
    by_op = {str(op).split(".")[1]: flops for op, flops in counter.get_flop_counts()["Global"].items()}
    eager = by_op.get("bmm", 0) + by_op.get("baddbmm", 0)
    fused = sum(flops for op, flops in by_op.items() if "scaled_dot_product" in op or "attention_backward" in op)
    return {
        "flops_per_sample": total / batch_size,
        "eager_attention_share": eager / total,
        "vision_attention_share": fused / total,
        "flops_by_operation": by_op,
    }


def measure(
    preset: str, batch_size: int, text_length: int, repeats: int, device: torch.device, bf16: bool
) -> dict[str, Any]:
    """FLOP shares, and median seconds of a training step with eager and with sdpa attention, alternating on one
    model."""
    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(preset_config(preset)).to(device)
    family = BridgeTowerFamily()
    family.prepare_for_training(model)
    train_step = TrainStep(model, family, device, "bf16" if bf16 else "fp32")
    inputs = batch(preset, batch_size, text_length, device)

    def step() -> float:
        synchronize(device)
        started = time.perf_counter()
        train_step(inputs)
        synchronize(device)
        return time.perf_counter() - started

    step()  # warm-up
    flops = flop_shares(model, step, batch_size)
    seconds: dict[str, list[float]] = {"eager": [], "sdpa": []}
    set_attention_implementation(model, "sdpa")
    step()  # warm-up
    for _ in range(repeats):
        for kernel in seconds:
            set_attention_implementation(model, kernel)
            seconds[kernel].append(step())
    eager, sdpa = (statistics.median(seconds[k]) for k in ("eager", "sdpa"))
    return {
        "flops": flops,
        "eager_step_seconds": eager,
        "sdpa_step_seconds": sdpa,
        "all_step_seconds": seconds,
        "sdpa_speedup": eager / sdpa,
        "saved_share_of_eager_step": 1 - sdpa / eager,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="large", choices=BRIDGETOWER_PRESETS)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--text_length", type=int, default=40, help="Caption tokens (New Yorker descriptions: ~40).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output", help="Also write the results to this JSON file.")
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict[str, Any] = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "text_length": args.text_length,
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "precision": "bf16" if args.bf16 else "fp32",
        **measure(args.preset, args.batch_size, args.text_length, args.repeats, device, args.bf16),
    }
    flops, t = results["flops"], results
    print(
        f"{args.preset}, text {args.text_length} tokens: {flops['flops_per_sample'] / 1e9:.1f} GFLOP per sample; "
        f"attention products in the eager text/cross layers {100 * flops['eager_attention_share']:.1f}% of FLOPs, "
        f"in the (fused) vision tower {100 * flops['vision_attention_share']:.1f}%"
    )
    print(
        f"step at batch {args.batch_size} on {results['machine']['device']} ({results['precision']}): eager "
        f"{t['eager_step_seconds']:.2f} s, sdpa {t['sdpa_step_seconds']:.2f} s = {t['sdpa_speedup']:.3f}x "
        f"({100 * t['saved_share_of_eager_step']:.1f}% of the eager step saved)"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
