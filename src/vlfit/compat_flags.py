"""Flags of optimum-habana's run_bridgetower.py that vlfit accepts so its command lines run unchanged.

``vlfit train`` takes run_bridgetower.py's flags after swapping the script name. Some of them mean nothing here:
the Gaudi-only flags of ``GaudiTrainingArguments`` (vlfit runs on NVIDIA GPUs or the CPU, never on a Gaudi HPU)
and the script's dataset-cache flag. transformers 4's ``--overwrite_output_dir``, which transformers 5 dropped, is
declared here too and means what it did (``vlfit.training.output_dir``). They are declared in the mixins
below (wired into ``VlfitTrainingArguments`` and ``DataArguments``) so that they parse, and ``compat_notes`` says
in one line per flag the user gave what vlfit does with it. The run_bridgetower.py flags vlfit uses
(``--throughput_warmup_steps``, the model-loading flags, ``--mediapipe_dataloader`` mapped to
``--decode_on_device``) get a line too.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from vlfit.flags import flag

logger = logging.getLogger(__name__)

_NOT_HERE = "vlfit runs on NVIDIA GPUs or the CPU, not on Gaudi HPUs"


def _gaudi_help(meaning: str) -> str:
    return f"optimum-habana (Gaudi HPU): {meaning} Accepted and ignored: {_NOT_HERE}."


@dataclass
class CompatTrainingFlags:
    """``GaudiTrainingArguments``' HPU flags (accepted, ignored) and transformers 4's ``--overwrite_output_dir``.

    Defaults are optimum-habana's, so ``--no_use_lazy_mode`` exists as it does there.
    """

    use_habana: bool = flag(False, _gaudi_help("run on a Gaudi HPU."))
    use_lazy_mode: bool = flag(True, _gaudi_help("run the HPU in lazy mode."))
    gaudi_config_name: str | None = flag(
        None,
        _gaudi_help("Gaudi config (HPU mixed precision, fused optimizer) name or path.")
        + " Pass --bf16 for bf16 mixed precision.",
    )
    use_hpu_graphs: bool = flag(False, _gaudi_help("deprecated form of --use_hpu_graphs_for_inference."))
    use_hpu_graphs_for_training: bool = flag(False, _gaudi_help("HPU graphs in training."))
    use_hpu_graphs_for_inference: bool = flag(False, _gaudi_help("HPU graphs in evaluation."))
    disable_tensor_cache_hpu_graphs: bool = flag(False, _gaudi_help("no tensor cache in HPU graphs."))
    max_hpu_graphs: int | None = flag(None, _gaudi_help("most HPU graphs to cache."))
    distribution_strategy: str = flag(
        "ddp",
        _gaudi_help("ddp or fast_ddp (Gaudi's own gradient all-reduce).")
        + " vlfit always uses DistributedDataParallel.",
        choices=["ddp", "fast_ddp"],
    )
    adjust_throughput: bool = flag(
        False, _gaudi_help("leave logging, evaluation and saving time out of the throughput.")
    )
    pipelining_fwd_bwd: bool = flag(False, _gaudi_help("an extra mark_step between forward and backward."))
    non_blocking_data_copy: bool = flag(False, _gaudi_help("copy batches to the HPU asynchronously."))
    sdp_on_bf16: bool = flag(False, _gaudi_help("reduced precision in the SDPA math backend."))
    overwrite_output_dir: bool = flag(
        False,
        "Start over in a non-empty --output_dir (its checkpoints are removed), as transformers 4 did. "
        "Without it, vlfit resumes a run in --output_dir made with the same flags and refuses one made with "
        "other flags.",
    )


@dataclass
class CompatDataFlags:
    """run_bridgetower.py's data flags: ``--overwrite_cache`` (ignored) and ``--mediapipe_dataloader`` (mapped)."""

    overwrite_cache: bool = flag(
        False,
        "run_bridgetower.py: overwrite the cached training and evaluation sets. Accepted and ignored: "
        "vlfit keeps no cache of preprocessed samples.",
    )
    mediapipe_dataloader: bool = flag(
        False,
        "run_bridgetower.py: decode on the Gaudi with its MediaPipe. vlfit turns on --decode_on_device "
        "instead (nvJPEG on an NVIDIA GPU; the CPU decodes without one).",
    )


@dataclass(frozen=True)
class FlagNote:
    """What vlfit does with a run_bridgetower.py flag.

    Attributes:
        effect: The rest of the line after ``--flag [value]:``; ``{value}`` is replaced by the flag's value.
        level: ``logging.INFO`` when vlfit honours the flag, ``logging.WARNING`` when it ignores or maps it.
    """

    effect: str
    level: int = logging.WARNING


_IGNORED_ON_CUDA = f"ignored: {_NOT_HERE}"

FLAG_NOTES: dict[str, FlagNote] = {
    # GaudiTrainingArguments
    "use_habana": FlagNote(_IGNORED_ON_CUDA),
    "use_lazy_mode": FlagNote(f"ignored: an HPU execution mode; {_NOT_HERE}"),
    "gaudi_config_name": FlagNote(
        f"ignored: a Gaudi config holds HPU settings; {_NOT_HERE} (for its mixed precision pass --bf16)"
    ),
    "use_hpu_graphs": FlagNote(f"ignored: HPU graphs are Gaudi-only; {_NOT_HERE}"),
    "use_hpu_graphs_for_training": FlagNote(f"ignored: HPU graphs are Gaudi-only; {_NOT_HERE}"),
    "use_hpu_graphs_for_inference": FlagNote(f"ignored: HPU graphs are Gaudi-only; {_NOT_HERE}"),
    "disable_tensor_cache_hpu_graphs": FlagNote(f"ignored: HPU graphs are Gaudi-only; {_NOT_HERE}"),
    "max_hpu_graphs": FlagNote(f"ignored: HPU graphs are Gaudi-only; {_NOT_HERE}"),
    "distribution_strategy": FlagNote(
        f"ignored: vlfit always uses DistributedDataParallel across processes (ddp); {_NOT_HERE}"
    ),
    "adjust_throughput": FlagNote(
        "ignored: vlfit's samples/s is over wall time, logging, evaluation and saving included"
    ),
    "pipelining_fwd_bwd": FlagNote(f"ignored: an HPU lazy-mode setting; {_NOT_HERE}"),
    "non_blocking_data_copy": FlagNote(
        f"ignored: an HPU setting ({_NOT_HERE}); on a GPU vlfit copies batches ahead of the step without blocking"
    ),
    "sdp_on_bf16": FlagNote(f"ignored: a Gaudi attention setting; {_NOT_HERE}"),
    "throughput_warmup_steps": FlagNote(
        "the first {value} training steps are left out of the reported samples/s and data-wait share", logging.INFO
    ),
    # run_bridgetower.py's ModelArguments
    "config_name": FlagNote(
        "passed to model loading: the model config is read from {value} instead of --model_name_or_path",
        logging.INFO,
    ),
    "use_fast_tokenizer": FlagNote(
        "passed to model loading; transformers 5 always loads the fast (tokenizers) tokenizer", logging.INFO
    ),
    "trust_remote_code": FlagNote("passed to model loading (from_pretrained)", logging.INFO),
    # run_bridgetower.py's DataTrainingArguments
    "overwrite_cache": FlagNote("ignored: vlfit keeps no cache of preprocessed samples; it preprocesses as it reads"),
    "preprocessing_num_workers": FlagNote(
        "ignored: vlfit preprocesses samples in the DataLoader workers as it reads them (--dataloader_num_workers)"
    ),
    "mediapipe_dataloader": FlagNote(
        "mapped to --decode_on_device: JPEGs are decoded on the GPU with nvJPEG (MediaPipe is Gaudi-only; without "
        "an NVIDIA GPU they are decoded on the CPU)"
    ),
}


def _flag(name: str, value: Any) -> str:
    """The flag as a user would write it: ``--name`` for True, ``--name False``, ``--name value``."""
    if value is True:
        return f"--{name}"
    return f"--{name} {value}"


def compat_notes(given: Collection[str], *argument_sets: Any) -> list[tuple[int, str]]:
    """One ``(level, line)`` per run_bridgetower.py flag the user gave, saying what vlfit does with it.

    Args:
        given: Names of the fields the command line or the flags file set (``--no_x`` sets ``x``).
        argument_sets: The parsed dataclasses, where the flags' values are looked up.

    Returns:
        The notes in ``FLAG_NOTES`` order, for the given flags only.
    """
    notes = []
    for name, note in FLAG_NOTES.items():
        if name not in given:
            continue
        value = next((getattr(args, name) for args in argument_sets if hasattr(args, name)), None)
        notes.append((note.level, f"{_flag(name, value)}: {note.effect.format(value=value)}"))
    return notes


def log_compat_flags(given: Collection[str], *argument_sets: Any) -> list[str]:
    """Log ``compat_notes`` (one line per given run_bridgetower.py flag); returns the lines."""
    notes = compat_notes(given, *argument_sets)
    for level, line in notes:
        logger.log(level, line)
    return [line for _, line in notes]
