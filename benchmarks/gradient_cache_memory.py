"""Peak memory and samples/s of training steps with and without gradient caching (``--gradient_cache_chunk_size``).

For each preset: batch 64 plain, batch 1024 plain and batch 1024 in chunks of 64, each in a process of its own
(random-init model, AdamW, random pixels and 32-token captions: the model's cost only, no data pipeline), one
warm-up step then ``--steps`` timed ones. Peak memory is the process's peak resident set (``ru_maxrss``: model,
optimizer state and the step's activations; on the CPU that is what runs out). Prints a markdown table.

    python benchmarks/gradient_cache_memory.py [--presets tiny,small] [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = (("plain", 64, None), ("plain", 1024, None), ("cached", 1024, 64))


def run_one(preset: str, batch: int, chunk: int | None, steps: int) -> dict:
    """One configuration, in this process: samples/s of ``steps`` timed steps and the peak resident set."""
    import torch

    from vlfit.models.family import LossScope
    from vlfit.models.registry import family_for_preset
    from vlfit.training.gradient_cache import gradient_cached_backward

    torch.manual_seed(0)
    family = family_for_preset(preset)
    config = family.preset_config(preset)
    model = family.build(config)
    family.prepare_for_training(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    size = family.image_size(config)
    vocab = min(family.vocab_size(config) or 1000, 1000)
    inputs = {
        "input_ids": torch.randint(5, vocab, (batch, 32)),
        "attention_mask": torch.ones(batch, 32, dtype=torch.long),
        "pixel_values": torch.randn(batch, 3, size, size),
    }
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if chunk is None:
            family.contrastive_loss(model, inputs, LossScope(symmetric=True)).backward()
        else:
            gradient_cached_backward(family, model, inputs, chunk, scope=LossScope(symmetric=True))
        optimizer.step()
        if step:
            times.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"samples_per_s": round(batch * len(times) / sum(times), 2), "peak_mib": round(peak_mib)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=3, metavar=("PRESET", "BATCH", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        preset, batch, chunk = args.child
        print(json.dumps(run_one(preset, int(batch), int(chunk) or None, args.steps)))
        return
    rows = []
    for preset in args.presets.split(","):
        for mode, batch, chunk in CONFIGS:
            command = [sys.executable, __file__, "--steps", str(args.steps), "--child", preset, str(batch),
                       str(chunk or 0)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                result = {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
            else:
                result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"preset": preset, "mode": mode, "batch": batch, "chunk": chunk, **result})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| preset | batch | chunk | peak memory (MiB) | samples/s |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        if "error" in row:
            print(f"| {row['preset']} | {row['batch']} | {row['chunk'] or '-'} | failed: {row['error']} | |")
        else:
            print(f"| {row['preset']} | {row['batch']} | {row['chunk'] or '-'} | {row['peak_mib']} | "
                  f"{row['samples_per_s']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
