"""A loader's workers hand their batches over a pipe that holds a batch (``vlfit.data.worker_pipes``): 1 MiB where
Linux lets a process ask, the same batches as in the main process, and the pipe as it was where it cannot."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from vlfit.data.pipeline import host_batches
from vlfit.data.sources.openers import open_split
from vlfit.data.worker_pipes import PIPE_BYTES, enlarge_pipe, loader_context
from vlfit.models.loading import load_model

pytestmark = pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="pipe sizes are Linux's")


def test_a_workers_batches_come_through_a_pipe_that_holds_a_batch_and_equal_the_main_processes(
    synthetic_dataset_dir,
):
    spec = load_model(model_preset="tiny", captions=lambda: ["a cat", "a dog"] * 10).inputs
    source = open_split(synthetic_dataset_dir, "train")
    in_process = list(host_batches(source, spec, batch_size=16, num_workers=0))
    loader = host_batches(source, spec, batch_size=16, num_workers=1).loader
    iterator = iter(loader)
    try:
        pipe = iterator._worker_result_queue._reader.fileno()
        assert fcntl.fcntl(pipe, fcntl.F_GETPIPE_SZ) == PIPE_BYTES  # Linux's default: 64 KiB
        from_worker = list(iterator)
    finally:
        iterator._shutdown_workers()
    assert [b.sample_ids for b in from_worker] == [b.sample_ids for b in in_process]
    for got, expected in zip(from_worker, in_process, strict=True):
        assert got.inputs.keys() == expected.inputs.keys()
        assert all(torch.equal(got.inputs[key], expected.inputs[key]) for key in got.inputs)
    queue = loader_context("forkserver").Queue()  # each start method's context: no process started
    assert fcntl.fcntl(queue._reader.fileno(), fcntl.F_GETPIPE_SZ) == PIPE_BYTES
    queue.close()


def test_a_pipe_the_system_will_not_enlarge_keeps_its_size():
    with open("/proc/sys/fs/pipe-max-size", encoding="ascii") as f:
        most = int(f.read())
    reader, writer = os.pipe()
    try:
        before = fcntl.fcntl(reader, fcntl.F_GETPIPE_SZ)
        if os.geteuid() != 0:  # root may exceed pipe-max-size
            assert not enlarge_pipe(reader, most * 2)
            assert fcntl.fcntl(reader, fcntl.F_GETPIPE_SZ) == before
        assert enlarge_pipe(reader, 2 * before) and fcntl.fcntl(reader, fcntl.F_GETPIPE_SZ) == 2 * before
    finally:
        os.close(reader)
        os.close(writer)
