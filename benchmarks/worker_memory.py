"""Loader-worker memory over a long run: RSS of each DataLoader worker must not grow with batches served.

Serves ``--samples`` samples (default 2,400) of a synthetic dataset through the fast pipeline with 2 workers and
records each worker's RSS (psutil) every ``--every`` batches. Prints the first, middle, last and peak RSS per
worker and the growth from the first quarter to the end.

    python benchmarks/worker_memory.py [--samples 2400] [--batch_size 48] [--workers 2] [--image_size 294]
"""

from __future__ import annotations

import argparse
import tempfile

import psutil
import torch

from vlfit.data.pipeline import InputPipeline, LoaderSettings, PipelineOptions
from vlfit.data.sources import open_splits
from vlfit.data.synthetic import SyntheticConfig, make_dataset, save_dataset
from vlfit.models.family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, InputSpec
from vlfit.models.tokenizer import train_caption_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2400)
    parser.add_argument("--batch_size", type=int, default=48)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--image_size", type=int, default=294)
    parser.add_argument("--every", type=int, default=5, help="sample RSS every N batches")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        # 400 distinct images, each served several times: the loader does the same work as on a larger set.
        save_dataset(make_dataset(SyntheticConfig(num_samples=500, seed=1), num_proc=2), folder, format="arrow")
        source = open_splits(dataset_name=folder)["train"]
        indices = [i % len(source) for i in range(args.samples)]
        source = source.select(indices)
        tokenizer = train_caption_tokenizer(source.captions(), vocab_size=1024)
        inputs = InputSpec(args.image_size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, tokenizer, max_seq_length=64)
        pipeline = InputPipeline(inputs, PipelineOptions(), torch.device("cpu"))
        loader = pipeline.loader(
            pipeline.dataset(source, train=True),
            batch_size=args.batch_size,
            settings=LoaderSettings(num_workers=args.workers, persistent_workers=True),
        )
        samples: dict[int, list[tuple[int, float, float]]] = {}
        served = 0
        for step, batch in enumerate(loader):
            served += len(batch)
            if step % args.every == 0:
                for child in psutil.Process().children(recursive=True):
                    info = child.memory_full_info()
                    samples.setdefault(child.pid, []).append((served, info.rss / 2**20, info.uss / 2**20))
            del batch
        main_rss = psutil.Process().memory_info().rss / 2**20

    print(f"served {served} samples in batches of {args.batch_size}, {args.workers} workers, "
          f"{args.image_size}px; main process RSS {main_rss:.0f} MiB")  # fmt: skip
    # RSS counts pages shared with the parent (fork) and mapped Arrow file pages; USS counts only the worker's own
    # private memory, which is where a leak would show.
    print(f"{'worker':>8} {'metric':>6} {'first':>8} {'25%':>8} {'last':>8} {'peak':>8} {'25%->end':>9}  (MiB)")
    for pid, series in samples.items():
        for column, metric in ((1, "rss"), (2, "uss")):
            values = [row[column] for row in series]
            quarter = values[len(values) // 4]
            print(f"{pid:>8} {metric:>6} {values[0]:>8.1f} {quarter:>8.1f} {values[-1]:>8.1f} {max(values):>8.1f} "
                  f"{values[-1] - quarter:>+9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
