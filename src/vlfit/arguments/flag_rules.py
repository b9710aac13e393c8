"""The flag rules: every rule that ties two flags together, or a flag to the kind of model or run, in one table
(``FLAG_RULES``). ``check_flag_rules`` checks it once per run, before any data opens, whichever door the flags came
through: the command line, a flags file and ``vlfit.train`` / ``vlfit.evaluate``'s keywords parse into the same
dataclasses, and ``vlfit.training.run`` checks those. Each refusal is one line naming the flag and what to do.

A rule reads flags by their field names; it is checked only where the run has every flag it reads (``vlfit eval``
has no ``--wise_ft_alpha``). A check of one flag alone (a range, a choice) stays in its dataclass's
``__post_init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

from vlfit.data.file_patterns import is_stream_spec
from vlfit.errors import ConfigError
from vlfit.models.presets import get_preset
from vlfit.models.reference import local_model_type, parse_model_reference

# Flags of a retrieval run: its contrastive or matching loss, and its retrieval and zero-shot evaluation. A --task vqa
# run trains with the VQA loss and reports VQA accuracy: none of them would do anything there.
RETRIEVAL_FLAGS = ("objective", "contrastive_loss", "contrastive_negatives", "gradient_cache_chunk_size",
                   "logit_scale_init_value", "hard_negative_column", "eval_pool_size", "rerank_top_k",
                   "rerank_score", "rerank_weight", "save_rerank_weight", "zeroshot_dataset",
                   "prompt_template", "matryoshka_dims", "matryoshka_prefix_weight")  # fmt: skip
# Flags of a --task vqa run: its answers.
VQA_FLAGS = ("answer_vocabulary", "max_answers")


class Flags(Mapping[str, Any]):
    """A run's flags by field name, read from its argument dataclasses, with values the run derived (``task``: a
    VQA model's folder makes a ``--task vqa`` run) in place of the flag's own."""

    def __init__(self, *arguments: Any, **derived: Any) -> None:
        self._fields: dict[str, tuple[Any, Field]] = {}
        for args in arguments:
            for flag in fields(args):
                self._fields.setdefault(flag.name, (args, flag))
        self._derived = derived

    def __getitem__(self, name: str) -> Any:
        if name in self._derived:
            return self._derived[name]
        args, _ = self._fields[name]
        return getattr(args, name)

    def __iter__(self) -> Iterator[str]:
        return iter({**self._fields, **self._derived})

    def __len__(self) -> int:
        return len({**self._fields, **self._derived})

    def changed(self, name: str) -> bool:
        """Whether flag ``name`` was set to other than its default."""
        args, flag = self._fields[name]
        if flag.default is not MISSING:
            default = flag.default
        else:
            default = flag.default_factory() if flag.default_factory is not MISSING else MISSING
        return getattr(args, name) != default


@dataclass(frozen=True)
class FlagRule:
    """One refused combination of flags.

    Attributes:
        flags: The flags the rule reads; the first is the one its message names first.
        refuses: Whether a run's ``Flags`` are refused.
        message: The one line said, a format string filled with the flags' values (``{objective}``) and ``{flag}``,
            the first of ``flags``.
    """

    flags: tuple[str, ...]
    refuses: Callable[[Flags], bool]
    message: str


def _vqa(flags: Flags) -> bool:
    return flags["task"] == "vqa"


def _trains_with_wise_ft(flags: Flags) -> bool:
    return flags["wise_ft_alpha"] is not None and bool(flags["do_train"])


def _has_no_vqa_head(model: str | None) -> bool:
    return bool(model) and not parse_model_reference(model).answers_questions


def _orders_training(flags: Flags) -> bool:
    return flags["train_sampling_strategy"] != "random"


def _streams_training(flags: Flags) -> bool:
    return bool(flags["streaming"]) or is_stream_spec(flags["train_file"])


def _groups_by_length(flags: Flags) -> bool:
    return flags["train_sampling_strategy"] == "group_by_length"


def _takes_square_images(preset: str | None, model: str | None) -> bool:
    """A preset or local folder known, before it loads, to take square images only (a hub id is checked once
    resolved: ``vlfit.training.sampling.check_train_sampling``)."""
    if preset is not None:
        return get_preset(preset).family != "siglip2"
    return bool(model) and local_model_type(parse_model_reference(model)) not in (None, "siglip2")


_GROUPS_NAFLEX = "--train_sampling_strategy group_by_length groups a NaFlex model's (SigLIP 2's) images by their patch "


def _is_dual_encoder_preset(preset: str | None) -> bool:
    return preset is not None and get_preset(preset).family != "bridgetower"


def _is_dual_encoder_folder(model: str | None) -> bool:
    return bool(model) and local_model_type(parse_model_reference(model)) not in (None, "bridgetower")


_VQA_NEEDS = "--task vqa fine-tunes BridgeTower (its fused tower answers questions); "
_WISE_FT = "--wise_ft_alpha mixes the trained weights with the starting ones, and "

FLAG_RULES: tuple[FlagRule, ...] = (
    # Which flags each task takes: a flag of the other task is refused instead of being ignored (or failing at the
    # first step, or crashing).
    *(
        FlagRule(
            (name, "task"),
            lambda flags, name=name: _vqa(flags) and flags.changed(name),
            "--{flag} is a retrieval run's flag; --task vqa trains with the VQA loss and reports VQA accuracy: drop it",
        )
        for name in RETRIEVAL_FLAGS
    ),
    *(
        FlagRule(
            (name, "task"),
            lambda flags, name=name: not _vqa(flags) and flags.changed(name),
            "--{flag} is a flag of --task vqa (its answers); this run is a retrieval run: add --task vqa or drop it",
        )
        for name in VQA_FLAGS
    ),
    # VQA answers from BridgeTower's fused tower: a dual encoder is refused before its data opens (with the question
    # column its caption, a CLIP or SigLIP run would fail on the column first).
    FlagRule(
        ("task", "model_preset"),
        lambda flags: _vqa(flags) and _is_dual_encoder_preset(flags["model_preset"]),
        _VQA_NEEDS + "--model_preset {model_preset} is a dual encoder without one: choose a BridgeTower preset (tiny, "
        "small ...) or checkpoint, or drop --task vqa",
    ),
    FlagRule(
        ("task", "model_name_or_path"),
        lambda flags: _vqa(flags) and _is_dual_encoder_folder(flags["model_name_or_path"]),
        _VQA_NEEDS + "--model_name_or_path {model_name_or_path} is a dual encoder (CLIP or SigLIP) without one: "
        "choose a BridgeTower checkpoint or preset, or drop --task vqa",
    ),
    FlagRule(
        ("answer_vocabulary", "do_train"),
        lambda flags: flags["answer_vocabulary"] is not None and not flags["do_train"],
        "--answer_vocabulary sets the answers a training run learns; an evaluation alone scores the model's own "
        "answers: drop the flag",
    ),
    # The training order: one sampler decides it (vlfit.training.sampling), over a map-style split.
    FlagRule(
        ("train_sampling_strategy", "caption_sampling"),
        lambda flags: _orders_training(flags) and flags["caption_sampling"] == "one_per_image",
        "--train_sampling_strategy {train_sampling_strategy} with --caption_sampling one_per_image: one_per_image "
        "sets the order itself (every image once per epoch, shuffled); drop one of the two",
    ),
    FlagRule(
        ("train_sampling_strategy", "streaming", "train_file"),
        lambda flags: _orders_training(flags) and _streams_training(flags),
        "--train_sampling_strategy {train_sampling_strategy} needs a map-style training split; a stream is read in "
        "the order of its shards (--shuffle_buffer shuffles it): drop the flag, or --streaming",
    ),
    FlagRule(
        ("train_sampling_strategy", "model_preset"),
        lambda flags: _groups_by_length(flags) and _takes_square_images(flags["model_preset"], None),
        _GROUPS_NAFLEX + "count; --model_preset {model_preset} takes every image at one size, so its batches have one "
        "length already: drop the flag",
    ),
    FlagRule(
        ("train_sampling_strategy", "model_name_or_path"),
        lambda flags: _groups_by_length(flags) and _takes_square_images(None, flags["model_name_or_path"]),
        _GROUPS_NAFLEX + "count; --model_name_or_path {model_name_or_path} takes every image at one size, so its "
        "batches have one length already: drop the flag",
    ),
    FlagRule(
        ("length_column_name", "train_sampling_strategy"),
        lambda flags: flags.changed("length_column_name"),
        "--length_column_name {length_column_name}: vlfit reads each image's patch count from its header for "
        "--train_sampling_strategy group_by_length, not from a column: drop the flag",
    ),
    # --wise_ft_alpha needs a start to mix with: pretrained weights, whole, on one process.
    FlagRule(
        ("wise_ft_alpha", "model_preset", "do_train"),
        lambda flags: _trains_with_wise_ft(flags) and flags["model_preset"] is not None,
        _WISE_FT + "--model_preset {model_preset} starts from random weights, nothing to mix towards: drop "
        "--wise_ft_alpha, or start from a checkpoint (--model_name_or_path)",
    ),
    FlagRule(
        ("wise_ft_alpha", "model_name_or_path", "task", "do_train"),
        lambda flags: _trains_with_wise_ft(flags) and _vqa(flags) and _has_no_vqa_head(flags["model_name_or_path"]),
        _WISE_FT + "{model_name_or_path} has no VQA head to mix (the run's starts at random): drop the flag, or "
        "start from a --task vqa run's folder",
    ),
    FlagRule(
        ("wise_ft_alpha", "lora_r", "do_train"),
        lambda flags: _trains_with_wise_ft(flags) and flags["lora_r"] is not None,
        "--wise_ft_alpha with --lora_r: merge the adapters (vlfit merge-lora), then vlfit wise-ft",
    ),
    FlagRule(
        ("wise_ft_alpha", "fsdp", "do_train"),
        lambda flags: _trains_with_wise_ft(flags) and bool(flags["fsdp"]),
        "--wise_ft_alpha with --fsdp is not supported: train, then run vlfit wise-ft on the result",
    ),
    # Re-ranking runs the fused tower outside the root forward, which under sharding nothing tests.
    FlagRule(
        ("rerank_top_k", "fsdp"),
        lambda flags: flags["rerank_top_k"] is not None and bool(flags["fsdp"]),
        "--rerank_top_k with --fsdp is not supported in training's evaluation: drop it, and evaluate the saved run "
        "with vlfit eval --rerank_top_k {rerank_top_k}",
    ),
    FlagRule(
        ("save_rerank_weight", "fsdp"),
        lambda flags: bool(flags["save_rerank_weight"]) and bool(flags["fsdp"]),
        "--save_rerank_weight with --fsdp is not supported: evaluate the saved run without --fsdp",
    ),
    FlagRule(
        ("matryoshka_prefix_weight", "matryoshka_dims"),
        lambda flags: flags.changed("matryoshka_prefix_weight") and not flags["matryoshka_dims"],
        "--matryoshka_prefix_weight weighs the losses of --matryoshka_dims's prefix sizes; without sizes there are "
        "none: add --matryoshka_dims or drop it",
    ),
    # --bf16_weights: a --bf16 run's weights in bf16, its optimizer over fp32 copies (vlfit.training.master_weights).
    FlagRule(
        ("bf16_weights", "bf16"),
        lambda flags: bool(flags["bf16_weights"]) and not flags["bf16"],
        "--bf16_weights keeps the weights of a --bf16 run in bf16 (the loss's logits in fp32 under --bf16's "
        "autocast); this run is fp32: add --bf16, or drop the flag",
    ),
    FlagRule(
        ("bf16_weights", "fsdp"),
        lambda flags: bool(flags["bf16_weights"]) and bool(flags["fsdp"]),
        "--bf16_weights with --fsdp is not supported (FSDP holds the weights in its own shards); drop --bf16_weights",
    ),
    FlagRule(
        ("bf16_weights", "deepspeed"),
        lambda flags: bool(flags["bf16_weights"]) and bool(flags["deepspeed"]),
        '--bf16_weights with --deepspeed: DeepSpeed keeps fp32 master weights itself in its bf16 mode ("bf16": '
        '{{"enabled": true}} in its config); drop --bf16_weights',
    ),
    FlagRule(
        ("bf16_weights", "optim"),
        lambda flags: bool(flags["bf16_weights"]) and flags["optim"] in ("lomo", "adalomo"),
        "--bf16_weights with --optim lomo or adalomo: LOMO updates each weight inside backward, where there is no "
        "fp32 copy to update; choose another --optim or drop --bf16_weights",
    ),
    # Gradient caching re-runs each chunk of the contrastive batch with gradient: with nothing else.
    FlagRule(
        ("objective", "gradient_cache_chunk_size"),
        lambda flags: flags.changed("objective") and bool(flags["gradient_cache_chunk_size"]),
        "--objective {objective} with --gradient_cache_chunk_size is not supported; drop one of the two",
    ),
    FlagRule(
        ("gradient_cache_chunk_size", "gradient_accumulation_steps"),
        lambda flags: flags["gradient_cache_chunk_size"] is not None and int(flags["gradient_accumulation_steps"]) > 1,
        "--gradient_cache_chunk_size with --gradient_accumulation_steps > 1: accumulation would split the "
        "contrastive batch into independent ones, which caching exists to avoid; raise "
        "--per_device_train_batch_size instead and drop --gradient_accumulation_steps",
    ),
    FlagRule(
        ("gradient_cache_chunk_size", "fsdp"),
        lambda flags: bool(flags["gradient_cache_chunk_size"]) and bool(flags["fsdp"]),
        "--gradient_cache_chunk_size with --fsdp is not supported (its second pass per chunk is untested under "
        "sharding); drop one of the two",
    ),
)


def check_flag_rules(*arguments: Any, **derived: Any) -> None:
    """Refuse the first combination of ``arguments``' flags that ``FLAG_RULES`` refuses.

    Args:
        arguments: The run's argument dataclasses (model, data, training).
        derived: Values the run derived, in place of the flag of that name (``task``).

    Raises:
        ConfigError: one line, naming the flag and what to do.
    """
    refuse_flags(Flags(*arguments, **derived))


class FlagValues(Flags):
    """A run's flags as plain values by field name, before its dataclasses are built (the command line's, read by
    ``vlfit.flag_index`` before the heavy imports): a flag not among them is not known yet, and its rules wait."""

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any], **derived: Any) -> None:
        self._values = {**values, **derived}
        self._defaults = defaults
        self._derived = derived

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def changed(self, name: str) -> bool:
        # A default the index could not record is taken as unchanged: the rule waits for the built arguments.
        return name in self._defaults and self._values[name] != self._defaults[name]


def refuse_flags(flags: Flags) -> None:
    """Refuse the first combination of ``flags`` that ``FLAG_RULES`` refuses (``check_flag_rules``).

    Raises:
        ConfigError: one line, naming the flag and what to do.
    """
    for rule in FLAG_RULES:
        if all(name in flags for name in rule.flags) and rule.refuses(flags):
            raise ConfigError(rule.message.format_map({**flags, "flag": rule.flags[0]}))


def check_vocabulary_is_trained(vocabulary_file: str | None, *, train: bool) -> None:
    """The rule of ``--answer_vocabulary`` on an evaluation alone, for code that has the two values only.

    Raises:
        ConfigError: naming the flag.
    """
    rule = next(rule for rule in FLAG_RULES if rule.flags == ("answer_vocabulary", "do_train"))
    values = {"answer_vocabulary": vocabulary_file, "do_train": train}
    if rule.refuses(values):  # type: ignore[arg-type]
        raise ConfigError(rule.message.format_map({**values, "flag": rule.flags[0]}))
