"""``EvalArguments``: the run settings of an evaluation (the ``TrainingArguments`` flags evaluation uses), which
``vlfit eval``, ``vlfit merge`` and ``vlfit wise-ft`` take; ``EvalCommandArguments``: ``vlfit eval``'s, with the
runtime doors' ``--embedding_dim`` (inherited from ``vlfit.arguments.runtime``)."""

from __future__ import annotations

from dataclasses import dataclass

from vlfit.arguments.runtime import runtime_arguments
from vlfit.arguments.sizes import check_sizes
from vlfit.flags import flag


@dataclass
class EvalArguments:
    """``vlfit eval``'s run settings: the ``TrainingArguments`` flags that evaluation uses, under their names."""

    output_dir: str | None = flag(None, "Where eval_results.json goes (default: the model folder).")
    per_device_eval_batch_size: int = flag(8, "Pairs per batch on each process.")
    dataloader_num_workers: int = flag(0, "Loader worker processes (0: in the main one).")
    dataloader_prefetch_factor: int | None = flag(None, "Batches each worker prepares.")
    dataloader_pin_memory: bool = flag(True, "Pin host batches (faster copies to a GPU).")
    bf16: bool = flag(False, "Run the model under bf16 autocast.")
    use_cpu: bool = flag(False, "Run on the CPU even when a GPU is there.")
    seed: int = flag(42, "Seed (pools are drawn in order; this seeds the rest).")
    report_to: str = flag("none", "Where to log metrics (none, tensorboard, wandb...).")
    disable_tqdm: bool = flag(False, "No progress bars.")
    ddp_backend: str | None = flag(None, "Under torchrun: nccl, gloo (CPUs)...")

    def __post_init__(self) -> None:
        check_sizes(self)  # --per_device_eval_batch_size, --dataloader_num_workers (vlfit.arguments.sizes)


@dataclass
class EvalCommandArguments(EvalArguments, runtime_arguments("embedding_dim")):
    """``vlfit eval``'s run settings: ``EvalArguments`` and ``--embedding_dim``, the size every embedding is scored
    at (its first that many dimensions, normalized again, as at the runtime doors; ``vlfit.evaluation.embedding_dim``).
    """
