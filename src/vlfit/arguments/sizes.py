"""The range of every size and count flag a user types, in one table (``SIZE_RANGES``, by field name), and the one
check of a value against it (``check_size``).

The argument dataclasses check their fields with it as they are built (``check_sizes``), and ``vlfit.flag_index``
checks the values typed on the command line with it before the heavy imports: a batch of 0 or a patch budget of
100000 is refused in one line with the range, in a fraction of a second, whichever command takes the flag. A name
means the same thing in every command that has it (``--batch_size``: items per batch). Nothing here imports more
than ``vlfit.errors``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vlfit.errors import ConfigError

# The most patches --max_num_patches gives an image. SigLIP 2 NaFlex resizes its position embeddings (a 16x16 grid)
# to each image's grid by bilinear interpolation, so the model sets no limit; its checkpoints were trained with budgets
# of at most 1024 patches, and a step's attention memory grows with the square of the budget. 4096 (a 1024 px square
# of 16 px patches) is four times that: more asked tens of GB at the first step, after the tokenizer and the data.
MAX_NUM_PATCHES = 4096


@dataclass(frozen=True)
class SizeRange:
    """A flag's lowest and highest value (``highest`` None: no upper bound) and what it counts."""

    lowest: int
    highest: int | None
    unit: str

    @property
    def allowed(self) -> str:
        return f"{self.lowest} to {self.highest}" if self.highest is not None else f"at least {self.lowest}"


SIZE_RANGES: dict[str, SizeRange] = {
    "max_seq_length": SizeRange(1, None, "tokens per caption; left out: the model's length"),
    "max_num_patches": SizeRange(
        1, MAX_NUM_PATCHES, "patches per image; left out: the model's budget, 256 for SigLIP 2"
    ),
    "embedding_dim": SizeRange(1, None, "dimensions per embedding; at most the model's, checked as it loads"),
    "rerank_top_k": SizeRange(1, None, "candidates per query; left out: no re-ranking"),
    "max_train_samples": SizeRange(1, None, "samples; left out: the whole training split"),
    "max_eval_samples": SizeRange(1, None, "samples; left out: the whole evaluation split"),
    "eval_pool_size": SizeRange(1, None, "images per recall@k pool; left out: the whole split"),
    "per_device_train_batch_size": SizeRange(1, None, "pairs per training batch on each process"),
    "per_device_eval_batch_size": SizeRange(1, None, "pairs per evaluation batch on each process"),
    "gradient_accumulation_steps": SizeRange(1, None, "batches per optimizer step"),
    "gradient_cache_chunk_size": SizeRange(1, None, "pairs per gradient-cache chunk; left out: no gradient cache"),
    "dataloader_num_workers": SizeRange(0, None, "loader worker processes; 0: the main one"),
    "throughput_warmup_steps": SizeRange(0, None, "steps left out of the throughput"),
    "batch_size": SizeRange(1, None, "items per batch"),
    "k": SizeRange(1, None, "results per query"),
    "max_answers": SizeRange(1, None, "answers in the vocabulary"),
}


def check_size(name: str, value: Any) -> None:
    """Refuse a value of size flag ``name`` (a key of ``SIZE_RANGES``) out of its range, in one line with the range.
    ``None`` (unset) passes, and so does a value of another type (the parser's to refuse).

    Raises:
        ConfigError: naming the flag, its value and the range.
    """
    size = SIZE_RANGES[name]
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return
    if value < size.lowest or (size.highest is not None and value > size.highest):
        raise ConfigError(f"--{name} {value} is out of range: give {size.allowed} ({size.unit})")


def check_sizes(values: Any) -> None:
    """``check_size`` of every size flag ``values`` has: a mapping of flag names to values, or an object whose
    attributes they are (an argument dataclass)."""
    for name in SIZE_RANGES:
        if isinstance(values, Mapping):
            if name in values:
                check_size(name, values[name])
        elif hasattr(values, name):
            check_size(name, getattr(values, name))
