"""``vlfit eval``: recall@1/5/10 both ways and matching accuracy of a model on one split.

Its flags are the model and data flags of ``vlfit train`` and the few run settings evaluation uses
(``EvalCommandArguments``, with the runtime doors' ``--embedding_dim``), so ``--help`` lists those, and answers without
importing torch. With ``--embedding_dim d`` every embedding is scored as its first d dimensions, normalized again
(``vlfit.evaluation.embedding_dim``); the metrics record the size (``eval_embedding_dim``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from vlfit.arguments import DataArguments, EvalArguments, ModelArguments
from vlfit.arguments.evaluation import EvalCommandArguments
from vlfit.commands.parsing import CommandParser, ParsedArguments

PROG = "vlfit eval"
# Training-only model and data flags: they still parse (a train command line evaluates as it is), unlisted.
TRAINING_ONLY = (
    "freeze_vision_model", "freeze_text_model", "freeze", "unfreeze_after_steps", "freeze_text_pooler",
    "logit_scale_init_value", "lora_r", "lora_alpha", "lora_dropout", "lora_target", "max_train_samples",
    "random_resized_crop", "horizontal_flip", "hard_negative_column", "max_bad_fraction", "overwrite_cache",
    "preprocessing_num_workers",
)  # fmt: skip


def parser() -> CommandParser:
    """The flags of ``vlfit eval``."""
    return CommandParser(
        (ModelArguments, DataArguments, EvalCommandArguments),
        prog=PROG,
        description="Evaluate a model on one split (--eval_split): recall@1/5/10 both ways, over pools of "
        "--eval_pool_size pairs, and matching accuracy; writes eval_results.json.",
        hidden_in_help=TRAINING_ONLY,
    )


def as_training_arguments(model: ModelArguments, settings: EvalArguments) -> Any:
    """The ``VlfitTrainingArguments`` of an evaluation: ``settings``, evaluation only, into ``--output_dir`` or the
    model folder."""
    from vlfit.training.arguments import VlfitTrainingArguments

    values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(EvalArguments)}  # not --embedding_dim
    output_dir = values.pop("output_dir") or model.model_name_or_path or "."
    return VlfitTrainingArguments(output_dir=output_dir, do_train=False, do_eval=True, **values)


def parse_values(values: dict[str, Any]) -> ParsedArguments:
    """``vlfit eval``'s arguments from ``{flag: value}`` (a flags file, or ``vlfit.evaluate``'s keyword arguments)."""
    (model, data, settings), given = parser().parse_values(values)
    return _parsed(model, data, settings, given)


def parse_arguments(argv: list[str] | None) -> ParsedArguments:
    """``vlfit eval``'s flags, or one ``.json``/``.yaml`` file holding them; ``None`` reads ``sys.argv[1:]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    (model, data, settings), given = parser().parse(argv)  # flags, or one flags file
    return _parsed(model, data, settings, given)


def _parsed(
    model: ModelArguments, data: DataArguments, settings: EvalCommandArguments, given: frozenset[str]
) -> ParsedArguments:
    return ParsedArguments(model, data, as_training_arguments(model, settings), given,
                           embedding_dim=settings.embedding_dim)  # fmt: skip


def evaluate_parsed(args: ParsedArguments) -> dict[str, Any]:
    """Evaluate with parsed flags (``vlfit eval`` and ``vlfit.evaluate``); returns the metrics."""
    from vlfit.commands.train import note_compat_flags
    from vlfit.evaluation.embedding_dim import at_embedding_dim
    from vlfit.training.run import run, setup_run

    note_compat_flags(args)
    setup = setup_run(args.model, args.data, args.training)
    setup.spec = at_embedding_dim(setup.spec, args.embedding_dim, setup.task)
    return run(args.model, args.data, args.training, setup=setup)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit eval``: metrics go to ``--output_dir`` (default: the model folder) as
    ``eval_results.json`` and to stdout. ``argv`` ``None`` reads ``sys.argv[1:]``."""
    args = parse_arguments(argv)
    evaluate_parsed(args)  # prints the metrics once, as a table
    if args.training.should_log:
        print(f"vlfit eval: metrics saved to {args.training.output_dir}/eval_results.json")
    return 0
