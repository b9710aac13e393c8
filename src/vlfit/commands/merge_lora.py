"""``vlfit merge-lora``: a plain checkpoint from a run's LoRA adapters (merged into their base's weights)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vlfit.commands.parsing import CommandParser

from vlfit.arguments import ModelArguments
from vlfit.errors import ConfigError
from vlfit.models.loading import load_model_bundle
from vlfit.models.lora import is_adapter_folder


@dataclass
class MergeArguments:
    model_name_or_path: str = field(metadata={"help": "A folder of LoRA adapters (a vlfit train --lora_r run)."})
    output_dir: str = field(metadata={"help": "Where the merged checkpoint, tokenizer and image processor go."})


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit merge-lora``."""
    (args,) = CommandParser(MergeArguments, prog="vlfit merge-lora").parse_args_into_dataclasses(args=argv)
    if not is_adapter_folder(args.model_name_or_path):
        raise ConfigError(
            f"{args.model_name_or_path} holds no LoRA adapters (adapter_config.json); it is already a plain checkpoint"
        )
    if os.path.abspath(args.output_dir) == os.path.abspath(args.model_name_or_path):
        raise ConfigError("--output_dir is the adapters' folder; merge into a folder of its own")
    bundle = load_model_bundle(ModelArguments(model_name_or_path=args.model_name_or_path))
    bundle.save(args.output_dir)
    print(f"merged {args.model_name_or_path} into {bundle.blueprint.checkpoint}'s weights: {args.output_dir}")
    return 0
