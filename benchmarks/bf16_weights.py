"""Would bf16 weights (with fp32 master weights in the optimizer) train faster than ``--bf16`` autocast on a CPU?

Autocast keeps the weights in fp32 and casts them to bf16 at every matrix product, forward and backward; a profile of
the ``base`` preset's bf16 step put 31% of its CPU time in those casts (``aten::copy_``, docs/results.md). The other
way mixed-precision training is done: the model's weights in bf16 (no casts in the step), an fp32 copy of each in
the optimizer (AdamW updates the copy, which is then copied back to bf16), so small updates are not lost to bf16's
8-bit mantissa. This times one training step (the family's contrastive loss, backward, clipping at 1.0, fused AdamW)
of a preset's random-init model on one synthetic batch, three ways alternately in one process: fp32, fp32 weights
under bf16 autocast (what ``--bf16`` runs), and bf16 weights with fp32 master weights; the median of ``--repeats``.

``--compile`` adds the three with the model under ``torch.compile`` (``--backend``, inductor by default: for the
first two what ``vlfit train --torch_compile [--bf16]`` runs), each with its own compiled wrapper so that none
recompiles for another's autocast state or dtype. Their first step (graph capture and code generation, forward and
backward) is timed separately, as ``compile_seconds``: it is left out of the rate, and a run pays it once.

``--train_steps N`` times the same three ways as whole ``vlfit train`` runs instead: fp32, ``--bf16`` and ``--bf16
--bf16_weights``, each N steps after two left out (``--throughput_warmup_steps``), on synthetic JPEGs already at the
preset's input side (``--dataloader_num_workers`` 1, no evaluation, no saving), alternately ``--repeats`` times; the
rate is the run's own ``train_samples_per_second``.

    python benchmarks/bf16_weights.py --preset base --batch_size 8 --repeats 3 [--compile] [--results FILE.json]
    python benchmarks/bf16_weights.py --preset base --batch_size 8 --repeats 2 --train_steps 4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from trainer_overhead import input_side, run_quietly

from vlfit.bench.measure import TrainStep
from vlfit.data.batch import Batch
from vlfit.efficiency.cpu import cpu_info
from vlfit.models.loading import load_model
from vlfit.training.master_weights import MasterWeights

CAPTIONS = ["a red circle on the left", "two blue squares at the top", "one green triangle"] * 40
# --train_steps: each way's flags, and the steps each run leaves out of its rate.
TRAIN_WAYS = {"fp32": [], "bf16 autocast (--bf16)": ["--bf16"],
              "bf16 weights, fp32 master (--bf16 --bf16_weights)": ["--bf16", "--bf16_weights"]}  # fmt: skip
TRAIN_WARMUP_STEPS = 2


def train_rates(preset: str, batch_size: int, steps: int, repeats: int) -> dict[str, list[float]]:
    """Each of ``TRAIN_WAYS`` as a whole ``vlfit train`` run, alternately ``repeats`` times: its samples/s."""
    side = str(input_side(preset))
    rates: dict[str, list[float]] = {name: [] for name in TRAIN_WAYS}
    with tempfile.TemporaryDirectory(prefix="vlfit-bf16-weights-") as folder:
        data = os.path.join(folder, "data")
        rows = str(int(1.25 * batch_size * (steps + TRAIN_WARMUP_STEPS)) + batch_size)  # one epoch: 80% train
        if run_quietly("make-data", "--output_dir", data, "--num_samples", rows, "--min_long_side", side,
                       "--max_long_side", side):  # fmt: skip
            sys.exit("vlfit make-data failed")
        for repeat in range(repeats):
            for way, (name, flags) in enumerate(TRAIN_WAYS.items()):
                out = os.path.join(folder, f"run-{repeat}-{way}")
                code = run_quietly("train", "--model_preset", preset, "--dataset_name", data, "--output_dir", out,
                                   "--max_steps", str(steps + TRAIN_WARMUP_STEPS), "--throughput_warmup_steps",
                                   str(TRAIN_WARMUP_STEPS), "--per_device_train_batch_size", str(batch_size),
                                   "--dataloader_num_workers", "1", "--eval_strategy", "no", "--save_strategy",
                                   "no", "--report_to", "none", "--seed", "0", *flags)  # fmt: skip
                if code:
                    sys.exit(f"vlfit train {' '.join(flags)} exited {code}")
                with open(os.path.join(out, "all_results.json"), encoding="utf-8") as f:
                    rates[name].append(float(json.load(f)["train_samples_per_second"]))
                print(f"{name}: {rates[name][-1]:.3f} samples/s", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="Also time fp32 and --bf16 under torch.compile.")
    parser.add_argument("--backend", default="inductor", help="The torch.compile backend of --compile.")
    parser.add_argument("--results", default=None, help="Write the figures here as JSON too.")
    parser.add_argument(
        "--train_steps",
        type=int,
        default=0,
        help="Time whole vlfit train runs of this many steps instead of one step in process.",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    if args.train_steps:
        rates = train_rates(args.preset, args.batch_size, args.train_steps, args.repeats)
        fp32 = statistics.median(rates["fp32"])
        rows = [{"way": name, "samples_per_s": round(statistics.median(values), 3),
                 "over_fp32": round(statistics.median(values) / fp32, 3), "runs": [round(v, 3) for v in values]}
                for name, values in rates.items()]  # fmt: skip
        for row in rows:
            print(f"{row['way']:<50} {row['samples_per_s']:8.2f} samples/s  {row['over_fp32']:5.2f}x fp32")
        if args.results:
            write_results(args, load_before, train_steps=args.train_steps, warmup_steps=TRAIN_WARMUP_STEPS, rows=rows)
        return
    torch.manual_seed(0)
    loaded = load_model(model_preset=args.preset, captions=lambda: CAPTIONS)
    model, family = loaded.model, loaded.spec.family
    size = loaded.spec.image_processor.size
    side = size.get("shortest_edge") or size.get("height")
    ids = torch.randint(5, 100, (args.batch_size, 40))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values": torch.randn(args.batch_size, 3, side, side)}  # fmt: skip
    if "BridgeTower" in type(model).__name__:
        inputs["pixel_mask"] = torch.ones(args.batch_size, side, side, dtype=torch.long)

    batch = Batch(inputs, sample_ids=[str(i) for i in range(args.batch_size)], positions=list(range(args.batch_size)))

    def step_of(precision: str, bf16_weights: bool = False, compiled: bool = False) -> Callable[[], None]:
        """vlfit bench's training step (loss, backward, clipping at 1.0, fused AdamW, ``TrainStep``) of the model,
        under ``torch.compile`` with ``compiled`` (a wrapper of its own, so that no way recompiles for another's
        autocast state or dtype); with ``bf16_weights``, of a bf16 copy of the model whose optimizer updates fp32
        copies of its weights and clips their gradients, as ``vlfit train --bf16 --bf16_weights`` does."""
        trained = copy.deepcopy(model) if bf16_weights else model
        step = TrainStep(torch.compile(trained, backend=args.backend) if compiled else trained, family,
                         torch.device("cpu"), precision)  # fmt: skip
        if bf16_weights:
            step.parameters = MasterWeights(trained, step.optimizer).trained
        dtype = step.input_dtype
        ready = replace(batch, inputs={k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()})
        return lambda: step(ready)

    ways = {"fp32": step_of("fp32"), "bf16 autocast (--bf16)": step_of("bf16"),
            "bf16 weights, fp32 master": step_of("bf16", bf16_weights=True)}  # fmt: skip
    if args.compile:
        ways["fp32 compiled"] = step_of("fp32", compiled=True)
        ways["bf16 autocast compiled"] = step_of("bf16", compiled=True)
        ways["bf16 weights compiled"] = step_of("bf16", bf16_weights=True, compiled=True)
    compile_seconds: dict[str, float] = {}
    for name, step in ways.items():  # warm-up (a compiled way's first step compiles it, timed apart)
        started = time.perf_counter()
        step()
        if "compiled" in name:
            compile_seconds[name] = round(time.perf_counter() - started, 1)
            step()
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, step in ways.items():
            started = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{args.preset} ({parameters:.0f}M parameters), batch {args.batch_size}, {torch.get_num_threads()} threads")
    rows = []
    for name, median in medians.items():
        rows.append({"way": name, "samples_per_s": round(args.batch_size / median, 3),
                     "over_fp32": round(medians["fp32"] / median, 3),
                     "step_seconds": [round(value, 3) for value in seconds[name]]})  # fmt: skip
        compiled = f"  (first step {compile_seconds[name]:.0f} s)" if name in compile_seconds else ""
        print(f"{name:<28} {args.batch_size / median:8.2f} samples/s  {medians['fp32'] / median:5.2f}x fp32{compiled}")
    if args.results:
        write_results(args, load_before, backend=args.backend, compile_seconds=compile_seconds, rows=rows)


def write_results(args: argparse.Namespace, load_before: float, **figures: object) -> None:
    """The run's record at ``--results``: the CPU, the preset and batch, the torch threads and ``figures``."""
    # Runnable processes (1-minute averages) at the start and the end: above the core count, the cores were shared.
    result = {**cpu_info().record(), "preset": args.preset, "batch_size": args.batch_size, "repeats": args.repeats,
              "torch_threads": torch.get_num_threads(),
              "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], **figures}  # fmt: skip
    with open(args.results, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
