"""``vlfit bench``: the input-pipeline throughput study, on this machine.

Modules, each importing only those listed before it (``selection``, ``published``, ``data``, ``measure`` and
``fit`` import nothing from here):

- ``selection``: the pipelines a sweep compares, what each is in ``vlfit train`` flags, and the rule that picks one.
- ``published``: the study's published figures (``published.json``) and their source.
- ``data``: the samples (synthetic New-Yorker-like JPEGs in memory by default) and the prepared copy.
- ``measure``: timed windows, the training step, the compute ceiling's window, peak host and device memory.
- ``plan``: ``SweepPlan``, its configurations and the machine-dependent defaults.
- ``stages``: per-stage time of one batch (read, decode, resize/crop, collate, copy, device stage, compute).
- ``session``: ``BenchSession``, what every configuration shares, and the measurement of one.
- ``sweep``: the ceiling, pipelines x workers (x prefetch factors) in loader and/or train mode, the profiles.
- ``report``: derived figures, verdict, the terminal table and ``bench.md``; ``chart``: ``bench.png``;
  ``files``: writing the three files.
- ``auto``: the probe behind ``vlfit train --dataloader_num_workers auto``.
- ``fit``: whether train mode fits in memory, estimated before the model is built.
"""
