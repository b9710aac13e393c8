"""``vlfit merge-lora``: a plain checkpoint from a run's LoRA adapters (merged into their base's weights)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from vlfit.commands.parsing import CommandParser
from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.model_card import MODEL_CARD_FILE, write_model_card
from vlfit.models.loading import LoadedModel, load_model
from vlfit.models.reference import parse_model_reference
from vlfit.models.vqa import model_answers

# What ``vlfit train`` leaves beside its adapters: the final metrics (Trainer.save_metrics).
RESULTS_FILE = "all_results.json"


@dataclass
class MergeArguments:
    model_name_or_path: str = flag(help="A folder of LoRA adapters (a vlfit train --lora_r run).")
    output_dir: str = flag(help="Where the merged checkpoint, tokenizer and image processor go.")


def card_metadata(folder: str) -> dict[str, Any]:
    """The YAML header of ``folder``'s model card, or ``{}`` when it has none that parses."""
    import yaml

    path = os.path.join(folder, MODEL_CARD_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return {}
    try:
        metadata = yaml.safe_load(text[4 : text.index("\n---", 4)])
    except yaml.YAMLError:
        return {}
    return metadata if isinstance(metadata, dict) else {}


def run_metrics(folder: str) -> dict[str, Any]:
    """The final metrics ``vlfit train`` saved in ``folder`` (``all_results.json``), or ``{}``."""
    path = os.path.join(folder, RESULTS_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        metrics = json.load(f)
    return metrics if isinstance(metrics, dict) else {}


def write_merged_card(loaded: LoadedModel, adapters: str, output_dir: str, command_line: str | None) -> str:
    """The model card of a merged checkpoint: its base, the adapters' run's datasets, license and final metrics."""
    trained = card_metadata(adapters)
    datasets = trained.get("datasets") or []
    return write_model_card(
        output_dir,
        family_name=loaded.family.name,
        base_model=loaded.spec.checkpoint,
        preset=None,
        datasets=[str(name) for name in datasets] if isinstance(datasets, list) else [],
        metrics=run_metrics(adapters),
        command_line=command_line,
        how_made=f"The LoRA adapters `{adapters}` are merged into its weights (`vlfit merge-lora`).",
        license=str(trained.get("license") or "other"),
        answers=model_answers(loaded.spec.config),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit merge-lora``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    (args,) = CommandParser(MergeArguments, prog="vlfit merge-lora").parse_args_into_dataclasses(args=argv)
    adapters = parse_model_reference(args.model_name_or_path, kinds=("checkpoint", "adapters", "export"))
    if adapters.kind != "adapters":
        raise ConfigError(
            f"{args.model_name_or_path} holds no LoRA adapters (adapter_config.json); it is already a plain checkpoint"
        )
    if os.path.abspath(args.output_dir) == os.path.abspath(args.model_name_or_path):
        raise ConfigError("--output_dir is the adapters' folder; merge into a folder of its own")
    loaded = load_model(model_name_or_path=adapters)
    loaded.save(args.output_dir)
    write_merged_card(loaded, args.model_name_or_path, args.output_dir, shlex.join(["vlfit", "merge-lora", *argv]))
    print(f"merged {args.model_name_or_path} into {adapters.base}'s weights: {args.output_dir}")
    return 0
