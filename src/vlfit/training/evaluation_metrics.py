"""What a training run's evaluation measures: recall@k and matching accuracy on the evaluation split (the
pipeline's batches, scored by ``vlfit.evaluation.retrieval``) and, for each ``--zeroshot_dataset``, zero-shot
accuracy. Every process calls it; in distributed runs the parts are gathered in rank order."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from accelerate.utils import gather_object
from tqdm.auto import tqdm

from vlfit.data.pipeline import LoaderSettings
from vlfit.evaluation.retrieval import EmbeddedSplit, evaluate_retrieval
from vlfit.evaluation.zeroshot import zeroshot_metrics
from vlfit.training.rerank_weight import save_swept_weight

logger = logging.getLogger(__name__)


def evaluation_metrics(trainer: Any, loader: Any) -> dict[str, float]:
    """The metrics of one evaluation, unprefixed.

    Args:
        trainer: The ``VlfitTrainer`` (its pipeline, family, model, arguments, zero-shot sets and accelerator).
        loader: The evaluation split's loader (``get_eval_dataloader``).
    """
    args = trainer.args
    dtype = next(trainer.model.parameters()).dtype
    batches = tqdm(
        trainer.pipeline.feed(loader, dtype, train=False),
        total=len(loader),
        desc="eval",
        unit="batch",
        leave=False,
        disable=args.disable_tqdm or not trainer.is_local_process_zero(),
    )
    metrics, skipped = evaluate_retrieval(
        trainer.family,
        trainer.model,
        batches,
        tokenizer=trainer.pipeline.inputs.tokenizer,
        max_seq_length=trainer.pipeline.inputs.max_seq_length,
        device=args.device,
        pool_size=trainer.eval_pool_size,
        autocast=trainer.autocast_smart_context_manager,
        gather_parts=gather_parts if trainer.accelerator.num_processes > 1 else None,
        rerank_top_k=getattr(trainer, "rerank_top_k", None),
        rerank_weight=getattr(trainer, "rerank_weight", None),
        # The final evaluation sweeps the itm+itc weight (vlfit.training.rerank_weight), not those during training.
        save_rerank_weight=partial(save_swept_weight, trainer) if _sweeps(trainer) else None,
    )
    if trainer.is_world_process_zero():
        for bad in skipped[:10]:
            logger.warning("evaluation left out bad sample %s: %s", bad.id, bad.reason)
        if len(skipped) > 10:
            logger.warning("evaluation left out %d bad samples in all", len(skipped))
    for zeroshot in trainer.zeroshot_sets:
        metrics.update(
            zeroshot_metrics(
                trainer.family,
                trainer.model,
                trainer.pipeline,
                zeroshot,
                dtype=dtype,
                batch_size=args.eval_batch_size,
                settings=LoaderSettings.from_training_args(args, drop_last=False),
                autocast=trainer.autocast_smart_context_manager,
            )
        )
    return metrics


def _sweeps(trainer: Any) -> bool:
    """Whether this evaluation sweeps and saves the re-ranking weight: the one after training, or vlfit eval's."""
    return getattr(trainer, "save_rerank_weight_to", None) is not None and not trainer.is_in_train


def gather_parts(part: EmbeddedSplit) -> list[EmbeddedSplit]:
    """Every process's evaluation part, in rank order (a collective: every process calls it once)."""
    return gather_object([part])
