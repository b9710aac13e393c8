"""What a run's evaluations re-rank by, and the weight a run saves for ``--rerank_score itm+itc``.

``vlfit eval`` re-ranks (``--rerank_top_k``) by the matching head alone and, with a weight, by the head's log-odds
plus the weight times the cosine: ``--rerank_weight``, else the weight the model's run saved (``rerank.json``,
``vlfit.inference.rerank_score``), as every other door does. ``vlfit eval --save_rerank_weight`` sweeps the weight
on its split and saves the best into the model folder; ``vlfit train`` does the same in its final evaluation (of
its validation split) when the model has a matching head, into its output folder. A run being trained is not
judged by the weight of the checkpoint it started from: its evaluations fuse only with ``--rerank_weight``. A
training run whose evaluation split has more than ``SWEEP_MAX_SAMPLES`` samples does not sweep unasked (it logs the
``vlfit eval`` command that does, on part of the split).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sized
from typing import Any

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.errors import ConfigError
from vlfit.inference.rerank_score import ITM, RERANK_FILE, resolve_rerank_score, save_rerank_file, saved_rerank_weight
from vlfit.models.itm import has_itm_head
from vlfit.models.reference import parse_model_reference

logger = logging.getLogger(__name__)

# The most evaluation samples a training run sweeps the weight on unasked: re-ranking keeps every sample's pixels in
# memory (images x 3 x side x side in the model's dtype: 2000 BridgeTower images at 288 px are 2 GB in fp32).
SWEEP_MAX_SAMPLES = 2000


def configure_rerank(trainer: Any, model_args: ModelArguments, data_args: DataArguments, training_args: Any) -> None:
    """Set ``trainer.rerank_weight`` (the weight evaluations fuse with; None: ITM alone) and
    ``trainer.save_rerank_weight_to`` (the folder the final evaluation's sweep saves into; None: no sweep), refusing
    in one line, before anything runs, what cannot be done.

    Raises:
        ConfigError: naming the flag, for ``--rerank_score``/``--rerank_weight`` without ``--rerank_top_k``,
            ``itm+itc`` without a weight given, saved or swept, ``--save_rerank_weight`` with ``--rerank_score itm``,
            of a model without a matching head or not in a local folder.
    """
    trainer.rerank_weight, trainer.save_rerank_weight_to = None, None
    asked = data_args.rerank_score is not None or data_args.rerank_weight is not None
    if asked and data_args.rerank_top_k is None and not data_args.save_rerank_weight:
        raise ConfigError("--rerank_score and --rerank_weight say how evaluation's re-ranked candidates are ordered: "
                          "add --rerank_top_k K, or drop them")  # fmt: skip
    sweep_to = _sweep_folder(trainer.model, model_args, data_args, training_args)
    if sweep_to is not None and not training_args.do_train and data_args.rerank_score == ITM:
        raise ConfigError("--save_rerank_weight sweeps the itm+itc weight: drop --rerank_score itm")
    if sweep_to is not None and not training_args.do_train and data_args.rerank_weight is not None:
        raise ConfigError("--save_rerank_weight sweeps the weight it saves: drop --rerank_weight")
    if sweep_to is not None and training_args.do_train and _too_large(trainer.eval_dataset):
        logger.info("re-ranking weight not swept: the evaluation split has over %d samples, whose pixels the sweep "
                    "would hold in memory; sweep it on part of it with vlfit eval --model_name_or_path %s "
                    "--save_rerank_weight --max_eval_samples %d", SWEEP_MAX_SAMPLES, sweep_to,
                    SWEEP_MAX_SAMPLES)  # fmt: skip
        sweep_to = None
    # The starting checkpoint's weight fits that checkpoint, not the run trained from it.
    saved = None if training_args.do_train else saved_rerank_weight(_model_folder(model_args))
    if sweep_to is None or data_args.rerank_weight is not None:
        by = resolve_rerank_score(data_args.rerank_score, data_args.rerank_weight, saved)
        trainer.rerank_weight = by.weight if by.fused else None
    trainer.save_rerank_weight_to = sweep_to
    trainer.eval_split_name = data_args.eval_split


def _too_large(dataset: Any) -> bool:
    """Whether a training run's evaluation split is too large to sweep unasked (``SWEEP_MAX_SAMPLES``)."""
    return isinstance(dataset, Sized) and len(dataset) > SWEEP_MAX_SAMPLES


def _model_folder(model_args: ModelArguments) -> str | None:
    """The local folder the model was read from (where its ``rerank.json`` is); None for a preset or a hub id."""
    name = model_args.model_name_or_path
    if name is None or not os.path.isdir(name):
        return None
    return name if parse_model_reference(name).kind in ("checkpoint", "adapters") else None


def _sweep_folder(model: Any, model_args: ModelArguments, data_args: DataArguments, training_args: Any) -> str | None:
    """Where the final evaluation's sweep saves the weight: a training run's output folder when its model has a
    matching head and it evaluates (its validation split), ``vlfit eval --save_rerank_weight``'s model folder."""
    if training_args.do_train:
        wanted = training_args.do_eval and has_itm_head(model) and not training_args.fsdp
        return training_args.output_dir if wanted else None
    if not data_args.save_rerank_weight:
        return None
    folder = _model_folder(model_args)
    if folder is None:
        raise ConfigError("--save_rerank_weight saves the weight into the model's folder: give --model_name_or_path "
                          "a local run folder (vlfit train's output)")  # fmt: skip
    if not has_itm_head(model):
        raise ConfigError("--save_rerank_weight: the model has no image-text matching head to re-rank with (a "
                          "BridgeTower model trained with --objective contrastive+itm has one); drop the "
                          "flag")  # fmt: skip
    return folder


def save_swept_weight(trainer: Any, record: dict[str, Any]) -> None:
    """Save a sweep's record (``vlfit.evaluation.retrieval.rerank_sweep``) as ``rerank.json`` in
    ``trainer.save_rerank_weight_to`` (the main process writes it), naming the split swept."""
    folder = trainer.save_rerank_weight_to
    if not trainer.is_world_process_zero():
        return
    path = save_rerank_file(folder, {**record, "split": getattr(trainer, "eval_split_name", None)})
    logger.info("re-ranking weight %g (itm+itc, top %d) saved to %s: every door re-ranks with it unless told "
                "otherwise", record["rerank_weight"], record["top_k"], path)  # fmt: skip


__all__ = ["RERANK_FILE", "configure_rerank", "save_swept_weight"]
