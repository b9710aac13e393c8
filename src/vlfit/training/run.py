"""Fine-tune and/or evaluate: sources -> model bundle -> datasets -> VlfitTrainer. One function, both commands."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict
from typing import Any

import torch
import transformers
from transformers import set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from vlfit.arguments import DataArguments, ModelArguments, VlfitTrainingArguments
from vlfit.data.bad_samples import BAD_SAMPLES_REPORT
from vlfit.data.dataset import ImageTextCollator, ImageTextDataset, build_image_transform
from vlfit.data.device_stage import DeviceStage
from vlfit.data.source_base import ImageTextSource
from vlfit.data.sources import open_splits
from vlfit.models.loading import load_model_bundle
from vlfit.training.distributed import describe_launch
from vlfit.training.preemption import PreemptionCallback, TrainingPreempted
from vlfit.training.trainer import VlfitTrainer

logger = logging.getLogger("vlfit")

EVAL_COLUMNS = ("caption_choices", "label")


def setup_logging(training_args: VlfitTrainingArguments) -> None:
    """Log to stdout at the Trainer's per-process level (main process: info)."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    level = training_args.get_process_log_level()
    if training_args.should_log and level > logging.INFO:
        level = logging.INFO
    logger.setLevel(level)
    logging.getLogger("vlfit").setLevel(level)
    transformers.utils.logging.set_verbosity(max(level, logging.WARNING))


def _limit(source: ImageTextSource, max_samples: int | None) -> ImageTextSource:
    if max_samples is None or max_samples >= len(source):
        return source
    return source.select(range(max_samples))


def _require_split(splits: dict[str, ImageTextSource], name: str, flag: str) -> ImageTextSource:
    if name not in splits:
        raise ValueError(f"{flag} needs a {name!r} split; the data has: {', '.join(splits) or 'none'}")
    return splits[name]


def run(model_args: ModelArguments, data_args: DataArguments, training_args: VlfitTrainingArguments) -> dict[str, Any]:
    """Train (``--do_train``) and/or evaluate (``--do_eval``) as the arguments say.

    Returns:
        The train metrics (prefixed ``train_``) and eval metrics (prefixed ``eval_``) that were computed.

    Raises:
        TrainingPreempted: SIGTERM or SIGINT stopped training; the message names the checkpoint saved at the stop.
        TooManyBadSamplesError: more than ``--max_bad_fraction`` of the samples read were bad.
        BadSampleError: a bad sample under ``--bad_sample_policy raise``.
    """
    setup_logging(training_args)
    if not (training_args.do_train or training_args.do_eval):
        raise ValueError("nothing to do: pass --do_train and/or --do_eval")
    # vlfit's collator decides the batch columns; the Trainer must not drop the ones the model signature lacks.
    training_args.remove_unused_columns = False
    # Pinned host memory only helps host-to-GPU copies.
    training_args.dataloader_pin_memory = training_args.dataloader_pin_memory and training_args.device.type == "cuda"
    set_seed(training_args.seed)

    splits = open_splits(
        **data_args.source_kwargs(), cache_dir=model_args.cache_dir, token=model_args.token, extra_columns=EVAL_COLUMNS
    )
    train_source = eval_source = None
    if training_args.do_train:
        train_source = _limit(_require_split(splits, "train", "--do_train"), data_args.max_train_samples)
    if training_args.do_eval:
        eval_source = _limit(_require_split(splits, data_args.eval_split, "--do_eval"), data_args.max_eval_samples)
    caption_source = train_source or splits.get("train") or eval_source
    describe_launch(training_args, len(train_source) if train_source is not None else None)

    bundle = load_model_bundle(
        **asdict(model_args),
        captions=caption_source.captions if caption_source is not None else None,
        max_seq_length=data_args.max_seq_length,
    )
    decode_on_device = data_args.decode_on_device
    if decode_on_device and training_args.device.type != "cuda":
        logger.warning(
            "--decode_on_device needs an NVIDIA GPU (nvJPEG) and the training device is %s: "
            "decoding on the CPU with the %s pipeline instead",
            training_args.device.type,
            data_args.image_pipeline,
        )
        decode_on_device = False
    transform_kwargs = {
        "image_size": bundle.image_size,
        "mean": bundle.image_mean,
        "std": bundle.image_std,
        "decode_on_device": decode_on_device,
    }
    train_dataset = eval_dataset = None
    if train_source is not None:
        train_dataset = ImageTextDataset(
            train_source,
            build_image_transform(
                data_args.image_pipeline, random_resized_crop=data_args.random_resized_crop, **transform_kwargs
            ),
            bad_sample_policy=data_args.bad_sample_policy,
        )
    if eval_source is not None:
        # No substitutes in evaluation: recall over a pool holding some pairs twice would not be comparable.
        eval_dataset = ImageTextDataset(
            eval_source,
            build_image_transform(data_args.image_pipeline, **transform_kwargs),
            bad_sample_policy=data_args.bad_sample_policy,
            substitute=False,
        )

    trainer = VlfitTrainer(
        model=bundle.model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=ImageTextCollator(bundle.tokenizer, data_args.max_seq_length, keep_columns=EVAL_COLUMNS),
        processing_class=bundle.tokenizer,
        device_stage=DeviceStage(
            bundle.image_size,
            bundle.image_mean,
            bundle.image_std,
            horizontal_flip=data_args.horizontal_flip,
            bad_sample_policy=data_args.bad_sample_policy,
        ),
        max_seq_length=data_args.max_seq_length,
        eval_pool_size=data_args.eval_pool_size,
        max_bad_fraction=data_args.max_bad_fraction,
    )
    preemption = PreemptionCallback()
    trainer.add_callback(preemption)
    logger.info(
        "model %s: %.1fM parameters, image %d px, pipeline %s%s, %s",
        model_args.model_name_or_path or f"preset {model_args.model_preset}",
        sum(p.numel() for p in bundle.model.parameters()) / 1e6,
        bundle.image_size,
        data_args.image_pipeline,
        " + device decode" if decode_on_device else "",
        f"{len(train_dataset)} training samples" if train_dataset is not None else "no training",
    )

    results: dict[str, Any] = {}
    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint
        if checkpoint is None and os.path.isdir(training_args.output_dir):
            checkpoint = get_last_checkpoint(training_args.output_dir)
            if checkpoint is not None:
                logger.info("resuming from %s (pass a new --output_dir to start over)", checkpoint)
        try:
            train_result = trainer.train(resume_from_checkpoint=checkpoint)
        finally:
            preemption.uninstall()  # when training raised, on_train_end never ran
            trainer.write_bad_samples_report()
        if preemption.stopped_at_step is not None:
            assert preemption.received is not None
            saved = os.path.join(training_args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{preemption.stopped_at_step}")
            raise TrainingPreempted(
                preemption.received, saved if os.path.isdir(saved) else None, preemption.stopped_at_step
            )
        if preemption.received is not None:
            logger.warning("a stop signal arrived as training was finishing: training completed, saving as usual")
        trainer.save_model()
        if trainer.is_world_process_zero():
            bundle.image_processor.save_pretrained(training_args.output_dir)
        metrics = dict(train_result.metrics)
        metrics["train_data_wait_share"] = trainer.throughput.total()["data_wait_share"]
        bad, read = trainer.bad_sample_totals()  # every process's, summed
        metrics["train_bad_samples"] = bad
        metrics["train_bad_sample_fraction"] = bad / read if read else 0.0
        if bad and trainer.is_world_process_zero():
            reports = os.path.join(training_args.output_dir, BAD_SAMPLES_REPORT)
            if training_args.world_size > 1:
                reports += " (and bad_samples_N.jsonl for process N)"
            logger.warning(
                "%d bad samples were skipped (%.2f%% of %d read); ids and reasons: %s", bad, 100 * bad / read, read,
                reports,
            )  # fmt: skip
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update({k if k.startswith("train_") else f"train_{k}": v for k, v in metrics.items()})
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return results
