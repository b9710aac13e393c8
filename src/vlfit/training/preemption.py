"""Preemption: on SIGTERM or SIGINT, finish the current step, save a complete checkpoint and exit non-zero.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM some time before killing a job; Ctrl-C sends SIGINT.
``PreemptionCallback`` turns either into "save and stop at the end of this optimizer step": the checkpoint the
Trainer then writes holds the model, optimizer, scheduler, RNG states and the step count that fixes the data
position, so ``--resume_from_checkpoint`` (or simply rerunning with the same ``--output_dir``) continues exactly.
``run()`` raises ``TrainingPreempted`` afterwards so that the process exits non-zero (128 + signal number, the
shell's convention) instead of looking like a finished run.

A second signal while the step finishes restores the previous handler and re-delivers the signal: the usual way
to force an immediate exit.

A training stream whose server can no longer be reached stops the run the same way (``StreamSourceLost``): the
trainer saves a checkpoint at the last completed step (the batches read for the next one are not counted as
consumed, so the resumed run reads them again) and the run ends with a one-line error (exit 2); rerunning the same
command once the server is back resumes from there.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from vlfit.errors import DataError

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


class TwoStageSignalHandler:
    """The first signal is recorded and announced (``announcement`` with the signal's name); a second one puts
    back the handlers that were there before and re-delivers itself: the usual way to force an immediate exit.

    Handlers can only be installed from the main thread; elsewhere ``install`` does nothing and signals keep
    their usual effect.

    Attributes:
        received: The first signal received, or ``None``.
    """

    announcement: str = "\nvlfit: received {name}\n"

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self, signals: tuple[signal.Signals, ...]) -> None:
        """Take over ``signals`` (from the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.received = signum
        # os.write, not print or logging: a signal handler may interrupt a write to the same stream.
        os.write(2, self.announcement.format(name=signal.Signals(signum).name).encode())

    def uninstall(self) -> None:
        """Put back the handlers that were there before (safe to call more than once)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class TrainingPreempted(RuntimeError):
    """Training stopped early on a signal after saving a checkpoint.

    Attributes:
        signum: The signal received.
        checkpoint: The checkpoint folder saved at the stop (``None`` if none could be found).
        exit_code: ``128 + signum``, what a shell reports for a process ended by that signal.
    """

    def __init__(self, signum: int, checkpoint: str | None, step: int) -> None:
        self.signum = signum
        self.checkpoint = checkpoint
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        where = f"saved checkpoint {checkpoint}" if checkpoint else "no checkpoint was found"
        super().__init__(
            f"training stopped by {name} at step {step}: {where}. Rerun the same command (or pass "
            f"--resume_from_checkpoint {checkpoint or '<checkpoint>'}) to continue from there."
        )


class PreemptionCallback(TwoStageSignalHandler, TrainerCallback):
    """Installs SIGTERM/SIGINT handlers for the duration of training and stops at the next step end.

    Handlers can only be installed from the main thread; elsewhere (a notebook running training in a thread) the
    callback does nothing and signals keep their usual effect.

    Attributes:
        received: The first signal received during training, or ``None``.
        stopped_at_step: The global step at which training was stopped for it, or ``None``.
    """

    announcement = "\nvlfit: received {name}: saving a checkpoint at the end of this step\n"

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        super().__init__()
        self.signals = signals
        self.stopped_at_step: int | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.received = None
        self.stopped_at_step = None
        self.install(self.signals)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._stop_requested(args):
            if self.received is None:  # another process got the signal: stop together, with its signal number
                self.received = int(signal.SIGTERM)
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at_step = state.global_step

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.uninstall()

    def _stop_requested(self, args: TrainingArguments) -> bool:
        """Whether this process, or in a distributed run any process, received a signal.

        Every process must stop at the same step, or the ones still training wait forever in the next collective:
        the flag is reduced across processes at each step end (one scalar; negligible next to a training step).
        """
        requested = self.received is not None
        if args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([1 if requested else 0], device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            requested = bool(flag.item())
        return requested


class StreamSourceLost(DataError):
    """A training stream's server became unreachable mid-run; a checkpoint was saved at the last completed step.

    Attributes:
        checkpoint: The checkpoint folder to resume from (``None`` when no step had completed: nothing to resume).
        step: The last completed step.
    """

    def __init__(self, reason: str, checkpoint: str | None, step: int) -> None:
        self.checkpoint = checkpoint
        self.step = step
        where = (
            f"saved checkpoint {checkpoint} at step {step}. Rerun the same command once it is reachable again to "
            "resume from there"
            if checkpoint
            else "no step had completed. Rerun the same command once it is reachable again"
        )
        super().__init__(f"the training data's source became unreachable ({reason}): {where}")
