"""``EvalArguments``: the run settings of an evaluation (the ``TrainingArguments`` flags evaluation uses), which
``vlfit eval``, ``vlfit merge`` and ``vlfit wise-ft`` take; ``EvalCommandArguments``: ``vlfit eval``'s, with the
runtime doors' ``--embedding_dim`` (inherited from ``vlfit.arguments.runtime``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlfit.arguments.runtime import runtime_arguments
from vlfit.arguments.sizes import check_sizes


@dataclass
class EvalArguments:
    """``vlfit eval``'s run settings: the ``TrainingArguments`` flags that evaluation uses, under their names."""

    output_dir: str | None = field(
        default=None, metadata={"help": "Where eval_results.json goes (default: the model folder)."}
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Pairs per batch on each process."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "Loader worker processes (0: in the main one)."})
    dataloader_prefetch_factor: int | None = field(default=None, metadata={"help": "Batches each worker prepares."})
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "Pin host batches (faster copies to a GPU)."})
    bf16: bool = field(default=False, metadata={"help": "Run the model under bf16 autocast."})
    use_cpu: bool = field(default=False, metadata={"help": "Run on the CPU even when a GPU is there."})
    seed: int = field(default=42, metadata={"help": "Seed (pools are drawn in order; this seeds the rest)."})
    report_to: str = field(default="none", metadata={"help": "Where to log metrics (none, tensorboard, wandb...)."})
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bars."})
    ddp_backend: str | None = field(default=None, metadata={"help": "Under torchrun: nccl, gloo (CPUs)..."})

    def __post_init__(self) -> None:
        check_sizes(self)  # --per_device_eval_batch_size, --dataloader_num_workers (vlfit.arguments.sizes)


@dataclass
class EvalCommandArguments(EvalArguments, runtime_arguments("embedding_dim")):
    """``vlfit eval``'s run settings: ``EvalArguments`` and ``--embedding_dim``, the size every embedding is scored
    at (its first that many dimensions, normalized again, as at the runtime doors; ``vlfit.evaluation.embedding_dim``).
    """
