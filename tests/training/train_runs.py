"""Helpers to run ``vlfit train`` on the tiny preset: in-process, as a child process that gets a signal, or as two
processes under torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nobody listens on now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This environment, offline, one torch thread, without the variables of an enclosing distributed launch."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    env.update(extra)
    return env


def torchrun_command(*args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on a free port, then ``args``. (``--standalone``,
    where the launcher binds a free port itself, was tried: one suite run on a loaded machine then hung an FSDP run
    mid-epoch until the test's timeout; the cause was not found, so the port is picked here, as it always was.)"""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), *args]  # fmt: skip


def run_torchrun(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun_command(*args)`` run to its end, its output captured, with no stdin and in a session of its own:
    nothing it reads or signals reaches the test's process (an xdist worker talks to its controller over stdin).

    A port free when picked can be taken before the launcher binds it (by another test's outgoing connection, from
    the same range): the launcher then fails at its rendezvous, before any process starts, and is run again on
    another port (at most twice more)."""
    for _ in range(3):
        done = subprocess.run(torchrun_command(*args), env=torchrun_env() if env is None else env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        if done.returncode == 0 or "EADDRINUSE" not in done.stderr:
            return done
    return done


@contextlib.contextmanager
def single_torch_thread() -> Iterator[None]:
    """Run torch on one thread: on a shared, loaded machine two OpenMP threads per step can be ten times slower
    (each parallel region waits for a descheduled thread), and runs compared with each other must use the same
    thread count anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_train_argv(data: str, output_dir: Path | str, *extra: str, steps: int = 20, workers: int = 0) -> list[str]:
    """``vlfit train`` flags for a short, deterministic CPU run that logs every step."""
    return [
        "--model_preset", "tiny", "--dataset_name", data, "--output_dir", str(output_dir), "--report_to", "none",
        "--max_steps", str(steps), "--per_device_train_batch_size", "6", "--logging_steps", "1",
        "--dataloader_num_workers", str(workers), "--disable_tqdm", "true", "--seed", "11", *extra,
    ]  # fmt: skip


def logged_losses(output_dir: Path | str, state_file: str = "trainer_state.json") -> dict[int, float]:
    """``{step: loss}`` from a run's (or a checkpoint's) ``trainer_state.json``."""
    state = json.loads((Path(output_dir) / state_file).read_text())
    losses: dict[int, float] = {}
    for entry in state["log_history"]:
        if "loss" in entry:
            assert entry["step"] not in losses, f"step {entry['step']} logged twice"
            losses[entry["step"]] = entry["loss"]
    return losses


@dataclass
class SignalledRun:
    """What a child ``vlfit train`` did after being signalled."""

    returncode: int
    stdout: str
    stderr: str
    steps_logged_before_signal: int


def train_until_signal(
    argv: list[str], *, after_steps: int, sig: signal.Signals = signal.SIGTERM, timeout: float = 240
) -> SignalledRun:
    """Run ``vlfit train`` in a new process group; signal the whole group once ``after_steps`` losses were printed.

    The whole group gets the signal, DataLoader workers included, as with Ctrl-C in a terminal or a scheduler
    signalling every process of a job. Fails (after killing the group) when the run ends or stalls first.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # as single_torch_thread, in the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlfit", "train", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    out: list[str] = []
    err: list[str] = []

    def pump(stream, sink: list[str], forward: queue.Queue | None) -> None:
        for line in stream:
            sink.append(line)
            if forward is not None:
                forward.put(line)
        if forward is not None:
            forward.put(None)

    threads = [
        threading.Thread(target=pump, args=(proc.stdout, out, lines), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, err, None), daemon=True),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    logged = 0
    try:
        while logged < after_steps:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                raise AssertionError(f"training ended before step {after_steps}:\n{''.join(err)[-3000:]}")
            if line.startswith("step "):  # each logging step's line (--disable_tqdm true)
                logged += 1
        os.killpg(proc.pid, sig)
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except (queue.Empty, subprocess.TimeoutExpired) as stalled:
        raise AssertionError(f"training stalled or did not exit:\n{''.join(err)[-3000:]}") from stalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for thread in threads:
            thread.join(timeout=10)
    return SignalledRun(proc.returncode, "".join(out), "".join(err), logged)


class SigtermAtStep(TrainerCallback):
    """Sends this process SIGTERM at the end of training step ``step``, as a scheduler would: vlfit's handler takes
    it (an in-process stop, for tests that resume in the same process)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
