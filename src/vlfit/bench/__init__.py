"""``vlfit bench``: the input-pipeline throughput study, on this machine.

- ``data``: the samples (synthetic New-Yorker-like JPEGs in memory by default) and what each pipeline reads.
- ``measure``: timed windows, the compute ceiling, peak host and device memory.
- ``stages``: per-stage time of one batch (read, decode, resize/crop, collate, copy, device stage, compute).
- ``sweep``: pipelines x workers (x prefetch factors) in loader and/or train mode.
- ``report``: derived figures, verdict, table, ``bench.json``, ``bench.md``, ``bench.png``.
- ``auto``: the configuration to use, and the probe behind ``vlfit train --dataloader_num_workers auto``.
"""
