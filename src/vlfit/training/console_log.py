"""What training prints on the console at each logging step and evaluation: one compact line, not the Trainer's dict.

The Trainer hands each log to its console callbacks (``ProgressCallback`` with a progress bar, ``PrinterCallback``
without), which print the dict as it is (``{'loss': '1.477', 'grad_norm': '5.92', 'learning_rate': '3.75e-05',
...}``). ``VlfitTrainer`` puts these callbacks in their place, which print instead::

    step 20/100  loss 2.3104  lr 4.0e-05  grad_norm 1.23  epoch 0.40  samples/s 412.3  data_wait 1.6%
    eval at step 20/100  t2i_recall@1 0.31  t2i_recall@5 0.72 ...

They leave out what a run prints as a table (``Trainer.log_metrics``): the training summary (``train_runtime``,
``train_loss`` ...) and an evaluation after training. The dict itself goes to the ``vlfit`` log at DEBUG
(``--log_level debug``); ``trainer_state.json`` keeps every log whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

logger = logging.getLogger(__name__)

# Training figures first, in this order, each with its own short name and format; any other figure follows.
_STEP_FIELDS: dict[str, tuple[str, str]] = {
    "loss": ("loss", "{:.4f}"),
    "learning_rate": ("lr", "{:.1e}"),
    "grad_norm": ("grad_norm", "{:.3g}"),
    "epoch": ("epoch", "{:.2f}"),
    "samples_per_second": ("samples/s", "{:.1f}"),
}
# Figures an evaluation logs that say how it was made, not how well the model did: left to the table and the state.
_EVALUATION_COUNTS = ("pool_size", "num_samples", "num_texts", "num_images", "runtime", "samples_per_second",
                      "steps_per_second")  # fmt: skip


def _value(value: Any, form: str | None = None) -> str:
    """``value`` in ``form``, or by default a fraction (a recall, an accuracy) to 3 decimals, other numbers to 4
    significant digits."""
    if not isinstance(value, float):
        return str(value)
    return (form or ("{:.3f}" if abs(value) <= 1 else "{:.4g}")).format(value)


def _step(state: Any) -> str:
    return f"{state.global_step}/{state.max_steps}" if state.max_steps else str(state.global_step)


def step_line(logs: Mapping[str, Any], state: Any) -> str:
    """One console line for a log of the Trainer's (a step's figures, or an evaluation's ``eval_*`` metrics).

    Args:
        logs: The log, as ``Trainer.log`` hands it to the callbacks.
        state: The ``TrainerState`` (its ``global_step`` and ``max_steps``).
    """
    if any(key.startswith("eval_") for key in logs):
        parts = [f"eval at step {_step(state)}"]
        for key, value in logs.items():
            name = key.removeprefix("eval_")
            if key == name or name in _EVALUATION_COUNTS or (name == "bad_samples" and not value):
                continue  # epoch (the step says when), and the counts
            parts.append(f"{name} {_value(value)}")
        return "  ".join(parts)
    parts = [f"step {_step(state)}"]
    for key, (name, form) in _STEP_FIELDS.items():
        if key in logs:
            parts.append(f"{name} {_value(logs[key], form)}")
    for key, value in logs.items():
        if key in _STEP_FIELDS or key == "total_flos" or (key == "bad_samples" and not value):
            continue
        if key == "data_wait_share" and isinstance(value, float):
            parts.append(f"data_wait {100 * value:.1f}%")
        else:
            parts.append(f"{key} {_value(value)}")
    return "  ".join(parts)


class _CompactConsole(TrainerCallback):
    """The console callbacks' ``on_log``: one ``step_line`` while training, nothing of what the run prints as a
    table; the dict at DEBUG."""

    _training = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._training = True
        return super().on_train_begin(args, state, control, **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._training = False
        return super().on_train_end(args, state, control, **kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if logs is None or "train_runtime" in logs or not self._training:
            return None
        if state.is_world_process_zero:
            logger.debug("step %d logs: %s", state.global_step, logs)
            self.write(step_line(logs, state))
        return None

    def write(self, line: str) -> None:
        print(line, flush=True)


class ConsoleProgressBar(_CompactConsole, ProgressCallback):
    """``ProgressCallback``'s bar, with a compact line for each log (written above the bar)."""

    def write(self, line: str) -> None:
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            super().write(line)


class ConsolePrinter(_CompactConsole, PrinterCallback):
    """``PrinterCallback`` (no bar: ``--disable_tqdm``), printing a compact line for each log."""


# The Trainer's console callbacks and vlfit's in their place.
CONSOLE_CALLBACKS: tuple[tuple[type[TrainerCallback], type[TrainerCallback]], ...] = (
    (ProgressCallback, ConsoleProgressBar),
    (PrinterCallback, ConsolePrinter),
)
