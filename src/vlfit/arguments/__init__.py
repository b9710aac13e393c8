"""Command-line arguments: the names run_bridgetower.py uses, plus vlfit's input-pipeline flags.

Parsed with ``vlfit.commands.parsing.CommandParser`` (``HfArgumentParser``) together with
``vlfit.training.arguments.VlfitTrainingArguments`` (every ``TrainingArguments`` flag) or, for ``vlfit eval``,
``EvalArguments``, so one JSON or YAML file can hold them all. Nothing here imports torch or transformers: a
command's ``--help`` answers without loading them.

One module per job: ``model`` (which model, what to freeze, LoRA), ``data`` (where the data is, streaming, the input
pipeline), ``evaluation`` (``vlfit eval``'s run settings), ``flag_rules`` (the rules that tie flags
together, one table).
"""

from vlfit.arguments.data import DataArguments, DataLocationArguments, StreamArguments
from vlfit.arguments.evaluation import EvalArguments
from vlfit.arguments.model import ModelArguments

__all__ = ["DataArguments", "DataLocationArguments", "EvalArguments", "ModelArguments", "StreamArguments"]
