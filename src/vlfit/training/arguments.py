"""``VlfitTrainingArguments``: every ``transformers.TrainingArguments`` flag, plus vlfit's training options."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainingArguments

from vlfit.arguments.sizes import check_sizes
from vlfit.compat_flags import CompatTrainingFlags
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.launch import prepare_launch
from vlfit.models.matryoshka import DEFAULT_PREFIX_WEIGHT

# Where a contrastive loss takes its negatives from (``--contrastive_negatives``).
CONTRASTIVE_NEGATIVES = ("local", "global")
# Which terms the contrastive loss has (``--contrastive_loss``).
CONTRASTIVE_LOSSES = ("model", "symmetric")
# What training optimizes (--objective; vlfit.training.itm_objective computes each).
OBJECTIVES = ("contrastive", "contrastive+itm", "itm")


@dataclass
class VlfitTrainingArguments(CompatTrainingFlags, TrainingArguments):
    """Every ``transformers.TrainingArguments`` flag, plus vlfit's training options.

    ``CompatTrainingFlags`` adds the Gaudi-only flags of run_bridgetower.py command lines, accepted and ignored.
    """

    train_sampling_strategy: str = flag(
        "random",
        "The training order. random (the default): shuffled each epoch. sequential: the split's order. "
        "group_by_length (NaFlex models, SigLIP 2): batches of images with similar patch counts, read from the "
        "image headers before training, in shuffled windows of up to 50 batches, so little of each batch is "
        "padding (train_padded_patch_share says how much). batch_rebalance is transformers' for language "
        "models and is refused.",
        choices=["random", "sequential", "group_by_length", "batch_rebalance"],
    )
    contrastive_negatives: str = flag(
        "local",
        "local: each process scores its captions against its own batch's images (what one process does "
        "with --per_device_train_batch_size). global: against the images of every process's batch (all-gathered "
        "with gradient), so the negatives are the whole global batch; same as local with one process.",
        choices=CONTRASTIVE_NEGATIVES,
    )
    contrastive_loss: str = flag(
        "model",
        "model: the model's own contrastive loss (BridgeTower: the mean of its text->image, "
        "text->cross-modal and image->cross-modal InfoNCE terms, as run_bridgetower trains). symmetric: also "
        "image->text, the direction image->caption retrieval and caption matching score, which the model's own "
        "loss never trains (for a dual encoder such as CLIP, whose loss is symmetric already, the same).",
        choices=CONTRASTIVE_LOSSES,
    )
    objective: str = flag(
        "contrastive",
        "What training optimizes. contrastive: the contrastive loss. contrastive+itm (BridgeTower): also "
        "the image-text matching head, on each batch's pairs and on hard negatives drawn from the batch's "
        "contrastive similarities (one caption per image, one image per caption). itm: the matching loss alone.",
        choices=OBJECTIVES,
    )
    matryoshka_dims: str | None = flag(
        None,
        "Comma-separated embedding sizes below the model's (e.g. 64,128,256): the contrastive loss is "
        "also taken at each prefix of the embedding, normalised again, and averaged with the full size's, each "
        "prefix weighted by --matryoshka_prefix_weight (Matryoshka representation learning), so the first d "
        "dimensions are an embedding on their own; the run records the sizes (input_spec.json) for "
        "--embedding_dim at every door.",
    )
    matryoshka_prefix_weight: float = flag(
        DEFAULT_PREFIX_WEIGHT,
        "--matryoshka_dims: each prefix size's loss weight against the full size's 1 (1.0: the plain "
        "mean of the Matryoshka paper). On the demo's data the plain mean cost recall at every size; 0.1 gained "
        "at 1/8 of the size, and a lower weight costs less at the full size (docs/results.md).",
    )
    gradient_cache_chunk_size: int | None = flag(
        None,
        "Gradient caching: embed the batch N pairs at a time without keeping activations, take the "
        "contrastive loss's gradient over the whole (with --contrastive_negatives global, global) batch, then "
        "re-run each chunk with gradient. The same gradient as the plain batch, in the memory of a batch of N, "
        "for about one more forward pass per step. Not with --gradient_accumulation_steps > 1.",
    )
    bf16_weights: bool = flag(
        False,
        "With --bf16: the model's weights in bf16 while it trains, with an fp32 copy of each that the optimizer "
        "updates and copies back after every step (gradients are summed and clipped in fp32), as DeepSpeed's bf16 "
        "mode does; checkpoints and the final model hold the fp32 weights. No casts of the weights at each matrix "
        "product: on a CPU with AMX, the base preset's training step at batch 16 ran 3.00x fp32's this way and 2.66x "
        "with --bf16 alone (docs/training.md). One process; not with --fsdp, --deepspeed or LOMO.",
    )
    throughput_warmup_steps: int = flag(
        0,
        "Leave the first N training steps out of the reported samples/s and data-wait share "
        "(compilation, autotuning and loader start-up make them slow), as optimum-habana does.",
    )
    wise_ft_alpha: float | None = flag(
        None,
        "End the run with WiSE-FT: the saved (and evaluated) weights are (1 - a) x the starting weights "
        "+ a x the fine-tuned ones (vlfit wise-ft draws the whole curve).",
    )

    def matryoshka_sizes(self) -> tuple[int, ...]:
        """The sizes of ``--matryoshka_dims``, ascending (empty without the flag).

        Raises:
            ConfigError: naming the flag, for an entry that is not a positive integer.
        """
        sizes = []
        for entry in str(self.matryoshka_dims or "").split(","):
            if entry.strip():
                if not entry.strip().isdigit() or int(entry) < 1:
                    raise ConfigError(
                        f"--matryoshka_dims {self.matryoshka_dims}: {entry.strip()!r} is not a positive integer; give "
                        "comma-separated embedding sizes, such as 64,128,256"
                    )
                sizes.append(int(entry))
        return tuple(sorted(set(sizes)))

    def __post_init__(self) -> None:
        if not 0.0 < self.matryoshka_prefix_weight <= 1.0:
            raise ConfigError(
                f"--matryoshka_prefix_weight must be in (0, 1], got {self.matryoshka_prefix_weight}: a prefix's "
                "loss weighs a part of the full size's"
            )
        if self.wise_ft_alpha is not None and not 0.0 <= self.wise_ft_alpha <= 1.0:
            raise ConfigError(f"--wise_ft_alpha must be between 0 and 1, got {self.wise_ft_alpha}")
        if self.contrastive_loss not in CONTRASTIVE_LOSSES:
            raise ConfigError(
                f"unknown --contrastive_loss {self.contrastive_loss!r}; choose one of: {', '.join(CONTRASTIVE_LOSSES)}"
            )
        if self.contrastive_negatives not in CONTRASTIVE_NEGATIVES:
            raise ConfigError(
                f"unknown --contrastive_negatives {self.contrastive_negatives!r}; choose one of: "
                f"{', '.join(CONTRASTIVE_NEGATIVES)}"
            )
        if self.train_sampling_strategy == "batch_rebalance":
            raise ConfigError(
                "--train_sampling_strategy batch_rebalance balances token counts across data-parallel processes for "
                "language models, and vlfit does not implement it: choose random (the default), sequential, or "
                "group_by_length (NaFlex models)"
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown --objective {self.objective!r}; choose one of: {', '.join(OBJECTIVES)}")
        # Rules tying two flags (gradient caching with --objective, accumulation, --fsdp): vlfit.arguments.flag_rules
        self.matryoshka_sizes()  # a list that is not one of sizes: refused now
        if self.enable_jit_checkpoint:
            # transformers' SIGTERM handler would be replaced by vlfit's PreemptionCallback, which does the same job.
            raise ConfigError(
                "--enable_jit_checkpoint is not needed: vlfit already saves a checkpoint when SIGTERM or SIGINT "
                "arrives and resumes from it when the same command is run again; drop the flag"
            )
        check_sizes(self)  # batch sizes, accumulation, workers ... (vlfit.arguments.sizes)
        prepare_launch(self)  # before TrainingArguments.__post_init__ sets up devices and the process group
        super().__post_init__()
        if self.fp16 and self.device.type == "cpu":
            raise ConfigError(
                "--fp16 on a CPU: mixed precision in fp16 needs a GPU (on the CPU it changes nothing, and throughput "
                "would be judged against an fp16 peak); use --bf16, which CPUs run, or drop --fp16"
            )
        if self.bf16_weights and self.world_size > 1:
            raise ConfigError(
                f"--bf16_weights runs on one process, and this launch has {self.world_size}: drop --bf16_weights (each "
                "process's --bf16 autocast still runs), or train on one process"
            )
        if self.fsdp and self.device.type == "cpu" and self.world_size < 2:
            raise ConfigError(
                "--fsdp shards the model over processes: launch at least two (torchrun --nproc_per_node 2 ...) or "
                "drop --fsdp"
            )
