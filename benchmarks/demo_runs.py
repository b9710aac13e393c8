"""What the benchmarks that train the demo's run share (``filter_noise.py``, ``matryoshka.py``,
``mined_negatives.py``, ``long_captions.py``): its flags from a script's own, one run of its recipe on a dataset,
and the steps of a run on a dataset (so that runs on different data take the same number)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

from vlfit.commands.demo import QUICK, DemoArguments, recipe
from vlfit.data.sources import open_splits
from vlfit.training.run import run

REPORTED = ("recall@", "matching", "zeroshot_top1")  # the eval_ metrics a run's row keeps


def demo_arguments(args: argparse.Namespace, **defaults: Any) -> DemoArguments:
    """The demo's flags for ``args`` (``--quick``, ``--model_preset``, ``--max_samples``, ``--epochs``, those it has),
    with ``defaults`` replacing the demo's own before them."""
    demo = DemoArguments(output_dir=args.output_dir, **defaults)
    if args.quick:
        demo = dataclasses.replace(demo, **{**QUICK, **defaults, "output_dir": args.output_dir})
    changed = {"model_preset": getattr(args, "model_preset", None), "num_samples": getattr(args, "max_samples", None),
               "num_train_epochs": getattr(args, "epochs", None)}  # fmt: skip
    return dataclasses.replace(demo, **{k: v for k, v in changed.items() if v})


def train(demo: DemoArguments, name: str, data_dir: str, overrides: dict | None = None, **data: Any) -> dict:
    """The demo's run on ``data_dir`` into ``<output_dir>/name``, with ``overrides`` of its ``TrainingArguments``
    and ``data`` of its ``DataArguments``; its metrics (``REPORTED``), model folder and seconds."""
    model_args, data_args, training_args = recipe(
        dataclasses.replace(demo, output_dir=os.path.join(demo.output_dir, name)), data_dir, overrides
    )
    data_args = dataclasses.replace(data_args, **data)
    shutil.rmtree(training_args.output_dir, ignore_errors=True)
    start = time.perf_counter()
    results = run(model_args, data_args, training_args)
    row = {"seconds": round(time.perf_counter() - start), "model": training_args.output_dir}
    row |= {key: round(value, 4) for key, value in sorted(results.items())
            if key.startswith("eval_") and any(part in key for part in REPORTED)}  # fmt: skip
    print(name, json.dumps(row))
    return row


def same_steps(demo: DemoArguments, data_dir: str) -> int:
    """The optimizer steps of the demo's run on ``data_dir`` (its epochs of whole batches)."""
    n_train = len(open_splits(dataset_name=data_dir)["train"])
    return math.floor(n_train / demo.per_device_train_batch_size) * math.ceil(demo.num_train_epochs)


def run_settings(demo: DemoArguments, steps: int) -> dict[str, Any]:
    """What a record says of the runs it compares: samples, preset, steps, batch size, evaluation pools."""
    return {"num_samples": demo.num_samples, "model_preset": demo.model_preset, "steps": steps,
            "batch_size": demo.per_device_train_batch_size, "eval_pool_size": demo.eval_pool_size}  # fmt: skip
