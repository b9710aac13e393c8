"""What ``vlfit train`` does with an ``--output_dir`` that already holds something, as HF scripts' users expect.

- An empty or new folder: a fresh run.
- A file (or a path under one): refused in one line, before the run is set up.
- ``--overwrite_output_dir``: a fresh run, whatever the folder holds (its old checkpoints and final state are
  removed, so a later rerun can neither resume from them nor take the old run as finished).
- ``--resume_from_checkpoint PATH``: resume from that checkpoint.
- A folder holding a run (``run_flags.json``, written when a run starts) made with the same flags: resume from its
  last checkpoint (what rerunning an interrupted command does), or, with none, start over.
- A folder holding that run finished (its training reached its last step): nothing to train, nothing written
  (``completed_at_step``); the run's saved metrics are its result.
- A folder holding another run, or files vlfit did not write: refused in one line naming the flags that differ.
  A run that stopped before its first step (no checkpoint, no model: a bad column, unreadable data) is not
  refused: the rerun with corrected flags replaces it, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from vlfit.atomic_files import refuse_file_as_folder, write_text_atomically
from vlfit.data.bad_samples import BAD_SAMPLES_REPORT
from vlfit.errors import ConfigError
from vlfit.version import __version__

logger = logging.getLogger(__name__)

RUN_FLAGS_FILE = "run_flags.json"
FINAL_STATE_FILE = "trainer_state.json"  # in output_dir: written by a run once its training ended and was saved
# Flags that do not change what a run computes: a rerun may change them and still resume.
NEUTRAL_FLAGS = frozenset(
    {
        "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "logging_dir", "logging_steps",
        "logging_strategy", "logging_first_step", "report_to", "run_name", "disable_tqdm", "log_level",
        "log_level_replica", "dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_pin_memory",
        "dataloader_persistent_workers", "save_total_limit", "push_to_hub", "hub_model_id", "hub_token", "token",
        "cache_dir", "do_eval", "eval_strategy", "eval_steps", "per_device_eval_batch_size", "debug",
        "save_strategy", "save_steps", "save_only_model", "save_on_each_node",
    }
)  # fmt: skip
_PRIMITIVES = (str, int, float, bool, type(None))
# What a run writes once it has trained: its final state, model and adapters (checkpoints are checkpoint-N folders).
_MODEL_FILES = frozenset({FINAL_STATE_FILE, "config.json", "adapter_config.json"})
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _plain(value: Any) -> Any:
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _PRIMITIVES) for v in value):
        return list(value)
    if hasattr(value, "value") and isinstance(value.value, _PRIMITIVES):  # enums (IntervalStrategy, ...)
        return value.value
    return None


def run_flags(*arguments: Any) -> dict[str, Any]:
    """The values of every field of the argument dataclasses that a JSON file can hold."""
    values: dict[str, Any] = {}
    for args in arguments:
        for f in dataclasses.fields(args):
            plain = _plain(getattr(args, f.name))
            if plain is not None or getattr(args, f.name) is None:
                values[f.name] = plain
    return values


def _differences(saved: dict[str, Any], current: dict[str, Any], names: set[str]) -> list[str]:
    differ = []
    for name in sorted(names - NEUTRAL_FLAGS):
        if name in current and saved.get(name) != current[name]:
            differ.append(f"--{name} {current[name]!r} (was {saved.get(name)!r})")
    return differ


def _remove_checkpoints(output_dir: str) -> None:
    """Remove the old run's checkpoints and its final state, so that nothing of it is resumed or taken as done."""
    final_state = os.path.join(output_dir, FINAL_STATE_FILE)
    if os.path.isfile(final_state):
        os.remove(final_state)
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and os.path.isdir(path):
            shutil.rmtree(path)


def _stopped_before_its_first_step(output_dir: str) -> bool:
    """Whether the run in ``output_dir`` left no checkpoint, no final state and no model: it failed before its
    first optimizer step (a bad column, unreadable data), so nothing of it can be resumed or used."""
    for name in os.listdir(output_dir):
        if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") or name in _MODEL_FILES or name.endswith(_WEIGHT_SUFFIXES):
            return False
    return True


def _remove_run_record(output_dir: str) -> None:
    """Remove what a run that never stepped wrote (its flags, its bad-sample reports), for the run replacing it."""
    for name in os.listdir(output_dir):
        stem, ext = os.path.splitext(BAD_SAMPLES_REPORT)
        if name == RUN_FLAGS_FILE or (name.startswith(stem) and name.endswith(ext)):
            os.remove(os.path.join(output_dir, name))


def resolve_output_dir(
    output_dir: str,
    flags: dict[str, Any],
    given: frozenset[str],
    *,
    overwrite: bool,
    resume_from_checkpoint: str | None,
    main_process: bool = True,
) -> str | None:
    """The checkpoint to resume from (``None``: a fresh run), or refuse a folder that holds another run.

    Args:
        output_dir: The run's ``--output_dir``.
        flags: ``run_flags`` of this run's arguments.
        given: The flags the user set (command line, flags file or keyword arguments).
        overwrite: ``--overwrite_output_dir``.
        resume_from_checkpoint: ``--resume_from_checkpoint``, when given.
        main_process: Only the main process removes the old checkpoints of ``--overwrite_output_dir``; every
            process starts over.

    Raises:
        ConfigError: the folder is a file (or lies under one), or holds a run with other flags, or files of something
            else.
    """
    refuse_file_as_folder(output_dir)
    if resume_from_checkpoint is not None:
        return resume_from_checkpoint
    if not os.path.isdir(output_dir) or not os.listdir(output_dir):
        return None
    if overwrite:
        if main_process:
            _remove_checkpoints(output_dir)
            logger.info("--overwrite_output_dir: starting over in %s", output_dir)
        return None
    record = os.path.join(output_dir, RUN_FLAGS_FILE)
    what = "pass --overwrite_output_dir to start over there, or another --output_dir"
    if not os.path.isfile(record):
        raise ConfigError(f"--output_dir {output_dir} is not empty and holds no vlfit run; {what}")
    with open(record, encoding="utf-8") as f:
        saved = json.load(f)
    differ = _differences(saved["flags"], flags, set(given) | set(saved.get("given", ())))
    if differ and _stopped_before_its_first_step(output_dir):
        if main_process:
            _remove_run_record(output_dir)
        logger.info(
            "--output_dir %s held a run that stopped before its first step (no checkpoint, no model), with other "
            "flags (%s): this run replaces it",
            output_dir,
            "; ".join(differ),
        )
        return None
    if differ:
        raise ConfigError(
            f"--output_dir {output_dir} holds another run (flags that differ: {'; '.join(differ)}); {what}, or "
            "--resume_from_checkpoint to continue that run with these flags"
        )
    checkpoint = get_last_checkpoint(output_dir)
    if checkpoint is not None:
        logger.info("resuming from %s: the run in --output_dir has the same flags", checkpoint)
    return checkpoint


def write_run_flags(output_dir: str, flags: dict[str, Any], given: frozenset[str]) -> None:
    """Record the run's flags in ``output_dir`` (``run_flags.json``), for ``resolve_output_dir`` of a rerun."""
    os.makedirs(output_dir, exist_ok=True)
    record = {"vlfit_version": __version__, "given": sorted(given), "flags": flags}
    write_text_atomically(os.path.join(output_dir, RUN_FLAGS_FILE), json.dumps(record, indent=1, sort_keys=True))


def _state(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, FINAL_STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def completed_at_step(
    output_dir: str,
    checkpoint: str | None,
    *,
    max_steps: int,
    num_train_epochs: float,
    overwrite: bool,
) -> int | None:
    """The step at which the run in ``output_dir`` finished, when resuming it would train nothing; else ``None``.

    A run that finished training saved its final model, metrics and ``trainer_state.json`` in ``output_dir``.
    Resuming it from its last checkpoint would not stop there: the Trainer trains a step before it checks the step
    count, so every rerun added a checkpoint past ``--max_steps`` and rewrote the metrics and the model card.

    Args:
        output_dir: The run's ``--output_dir``.
        checkpoint: What ``resolve_output_dir`` returned: the checkpoint the run would resume from, or ``None``.
        max_steps: ``--max_steps`` (``<= 0``: the epochs decide).
        num_train_epochs: ``--num_train_epochs``.
        overwrite: ``--overwrite_output_dir`` (a fresh run: never complete).
    """
    if overwrite or _state(output_dir) is None:
        return None
    state = _state(checkpoint) if checkpoint is not None else _state(output_dir)
    if state is None:
        return None
    step = int(state.get("global_step", 0))
    if max_steps > 0:
        planned = max_steps
    elif int(state.get("num_train_epochs", -1)) == math.ceil(num_train_epochs):
        planned = int(state.get("max_steps", 0))  # the step count its epochs came to
    else:
        return None
    return step if 0 < planned <= step else None


def saved_results(output_dir: str) -> dict[str, Any]:
    """The metrics a finished run saved (``train_results.json``, ``eval_results.json``), named as ``run`` returns
    them: every training metric prefixed ``train_``."""
    results: dict[str, Any] = {}
    for split in ("train", "eval"):
        path = os.path.join(output_dir, f"{split}_results.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                metrics = json.load(f)
            results.update({k if k.startswith(f"{split}_") else f"{split}_{k}": v for k, v in metrics.items()})
    return results
