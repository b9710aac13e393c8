"""What a loader worker pays to allocate and fill a uint8 pixel batch: in shared memory (torch's ``default_collate``
in a worker allocates every batch there) against ``vlfit.data.worker_memory.new_uint8`` for a worker, which takes
shared memory only for a batch too large to cross to the main process by value.

For each batch size: the median time of allocating the batch and writing every byte once (a transform's writes),
over ``--calls`` calls, in ``--rounds`` alternated rounds; medians of the rounds.

    python benchmarks/worker_batch_allocation.py [--calls 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlfit.data.worker_memory import BY_VALUE_BYTES, new_uint8

# (images, side): tiny's batch of 16 at 64 px (196 KiB, crosses by value), and larger ones that cross in shared memory.
BATCHES = ((16, 64), (4, 224), (48, 288))


def _shared(shape: tuple[int, ...]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(int(torch.Size(shape).numel()))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


def _median_us(allocate, shape: tuple[int, ...], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        allocate(shape).fill_(7)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a loader worker
    ways = {"shared memory": _shared, "vlfit (worker)": lambda shape: new_uint8(shape, shared=True)}
    for images, side in BATCHES:
        shape = (images, side, side, 3)
        rounds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, allocate in ways.items():
                rounds[name].append(_median_us(allocate, shape, args.calls))
        size = images * side * side * 3
        crossing = "by value" if size <= BY_VALUE_BYTES else "in shared memory"
        figures = ", ".join(f"{name} {statistics.median(values):.0f} us" for name, values in rounds.items())
        print(f"{images} x {side}px ({size / 1024:.0f} KiB, crosses {crossing}): {figures}")


if __name__ == "__main__":
    main()
