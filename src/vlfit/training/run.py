"""Fine-tune and/or evaluate: the run's data (``vlfit.data.sources.open_run_data``) -> model -> datasets ->
VlfitTrainer. One function, both commands."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from vlfit.arguments import DataArguments, ModelArguments
from vlfit.arguments.flag_rules import check_flag_rules
from vlfit.data.bad_samples import BAD_SAMPLES_REPORT
from vlfit.data.pipeline import InputPipeline, PipelineOptions
from vlfit.data.sources.base import ImageTextSource
from vlfit.data.sources.labelled import ZeroShotSet
from vlfit.data.sources.openers import open_run_data
from vlfit.data.stream import ShardStream
from vlfit.data.stream.train_stream import StreamSettings
from vlfit.data.vqa import check_has_answers
from vlfit.efficiency.cpu import cpu_info
from vlfit.efficiency.flops import ComputeEfficiency
from vlfit.efficiency.peaks import PeakFlops, matmul_precision, peak_flops
from vlfit.errors import ConfigError, out_of_memory_in_one_line
from vlfit.model_card import WiseFtMix, write_model_card
from vlfit.models.family import ModelFamily
from vlfit.models.interpolation import interpolate
from vlfit.models.loading import (
    ModelSpec,
    build_model,
    resolve_model,
    save_image_processor,
    save_inputs,
    saved_tokenizer,
)
from vlfit.models.logit_scale import set_logit_scale
from vlfit.models.lora import BASE_MODEL_DIR, LoraSettings, apply_lora, group_of, trainable_parameters
from vlfit.models.matryoshka import check_prefix_sizes, with_matryoshka
from vlfit.models.vqa import model_answers
from vlfit.training.arguments import VlfitTrainingArguments
from vlfit.training.distributed import describe_launch
from vlfit.training.itm_objective import prepare_model_for_objective, trained_heads
from vlfit.training.preemption import PreemptionCallback, TrainingPreempted
from vlfit.training.rerank_weight import configure_rerank
from vlfit.training.sampling import check_train_sampling, training_sampler
from vlfit.training.trainer import VlfitTrainer
from vlfit.training.unfreeze import UnfreezeCallback
from vlfit.training.vqa import (
    check_streamed_answers,
    pipeline_columns,
    trainer_class,
    vqa_blueprint,
)

logger = logging.getLogger(__name__)


def compute_efficiency(
    flops_per_sample: float, samples_per_second: float, training_args: VlfitTrainingArguments
) -> ComputeEfficiency:
    """TFLOP/s and MFU of a run against its device's peak in the precision its matmuls ran in."""
    return ComputeEfficiency(flops_per_sample, samples_per_second, run_peak(training_args),
                             processes=training_args.world_size)  # fmt: skip


def run_peak(training_args: VlfitTrainingArguments) -> PeakFlops:
    """The peak of the run's device in the precision its matmuls run in: a data sheet's, or measured once per
    process (``vlfit.efficiency.peaks``); asked before training, so a CPU is measured before the run loads it."""
    autocast = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    device = training_args.device
    return peak_flops(device, matmul_precision(device, autocast))


@dataclass
class RunSetup:
    """What a run is made of before any model weights exist: the data, the model's spec and the pipeline.

    Attributes:
        train_source: The training split (``None`` without ``--do_train``).
        eval_source: The evaluation split (``None`` without ``--do_eval``).
        spec: The model's family, config, tokenizer and image processor.
        pipeline: The input pipeline every loader of the run comes from.
        zeroshot_sets: The labelled splits every evaluation classifies zero-shot (``--zeroshot_dataset``).
        train_stream: The training split when it is streamed (``train_source`` is then ``None``).
        task: What the run fine-tunes for (``DataArguments.run_task``): ``retrieval`` or ``vqa``.
    """

    train_source: ImageTextSource | None
    eval_source: ImageTextSource | None
    spec: ModelSpec
    pipeline: InputPipeline
    zeroshot_sets: list[ZeroShotSet] = field(default_factory=list)
    train_stream: ShardStream | None = None
    task: str = "retrieval"


def setup_run(model_args: ModelArguments, data_args: DataArguments, training_args: VlfitTrainingArguments) -> RunSetup:
    """Open the run's data, resolve the model (training a preset's tokenizer once) and build the input pipeline."""
    if not (training_args.do_train or training_args.do_eval):
        raise ConfigError("nothing to do: pass --do_train and/or --do_eval")
    set_seed(training_args.seed)
    if training_args.do_train and data_args.streams_training():
        _check_streamed_training(training_args)
    task = data_args.run_task(model_args.model_name_or_path)
    check_flag_rules(model_args, data_args, training_args, task=task)
    check_streamed_answers(task, streamed=training_args.do_train and data_args.streams_training(),
                           vocabulary_file=data_args.answer_vocabulary, model_preset=model_args.model_preset,
                           model_name_or_path=model_args.model_name_or_path)  # fmt: skip
    data = open_run_data(
        data_args.run_source_kwargs(task),
        train=training_args.do_train,
        evaluate=training_args.do_eval,
        streaming=data_args.streaming,
        stream=StreamSettings(
            weights=data_args.train_data_weights,
            shuffle_buffer=data_args.shuffle_buffer,
            resampled=data_args.resampled,
            seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
            rank=training_args.process_index,
            world_size=training_args.world_size,
        ),
        eval_split=data_args.eval_split,
        max_train_samples=data_args.max_train_samples,
        max_eval_samples=data_args.max_eval_samples,
        hard_negative_column=data_args.hard_negative_column,
        extra_columns=pipeline_columns(task),
        zeroshot_datasets=data_args.zeroshot_dataset or (),
        zeroshot_label_column=data_args.zeroshot_label_column,
        zeroshot_split=data_args.zeroshot_split,
        prompt_templates=data_args.prompt_template,
        cache_dir=model_args.cache_dir,
        token=model_args.token,
    )
    if data.train is not None:
        _warn_batch_over_split(len(data.train), training_args)
    if task == "vqa":  # a split without answers is refused before a tokenizer is trained on its questions
        for source in (data.train, data.eval):
            if source is not None:
                check_has_answers(source)
    spec = resolve_model(
        **model_args.source_keywords(),
        captions=data.captions,
        max_seq_length=data_args.max_seq_length,
        max_num_patches=data_args.max_num_patches,
        stretch_text=training_args.do_train,  # longer captions than the text positions: stretched (Long-CLIP)
    )
    if training_args.do_train:  # the sizes this run trains at, recorded with its inputs (a fine-tune's own flag)
        spec.inputs = dataclasses.replace(spec.inputs, matryoshka_dims=training_args.matryoshka_sizes())
    if training_args.do_train:
        check_train_sampling(spec.inputs, training_args)
    if task == "vqa":
        spec = vqa_blueprint(spec, data.train, data.eval, data_args.max_answers, train=training_args.do_train,
                             vocabulary_file=data_args.answer_vocabulary)  # fmt: skip
    pipeline = InputPipeline(
        spec.inputs, PipelineOptions.from_arguments(data_args), training_args.device, pipeline_columns(task)
    )
    return RunSetup(data.train, data.eval, spec, pipeline, data.zeroshot, train_stream=data.train_stream, task=task)


def _embedding_size(family: ModelFamily, model: torch.nn.Module, spec: Any) -> int:
    """The size of ``model``'s embeddings: one caption's, embedded once before training."""
    with torch.no_grad():
        return int(family.encode_text(model, **spec.inputs.tokenize(["a"])).shape[-1])


def _check_streamed_training(training_args: VlfitTrainingArguments) -> None:
    """Refuse training settings a streamed training split cannot honour."""
    if training_args.max_steps is None or training_args.max_steps <= 0:
        raise ConfigError(
            "a streamed training split has no length: give --max_steps (the number of optimizer steps to train); "
            "epochs end when the stream's shards are read through (never with --resampled)"
        )
    if training_args.dataloader_persistent_workers:
        raise ConfigError(
            "--dataloader_persistent_workers with a streamed training split: a worker keeps the epoch it started "
            "with, so every epoch would read the first one's order; drop the flag"
        )


def _warn_batch_over_split(samples: int, training_args: VlfitTrainingArguments) -> None:
    """A global batch larger than the training split holds the samples there are: say so."""
    if training_args.per_device_train_batch_size * training_args.world_size > samples:
        logger.warning(
            "--per_device_train_batch_size %d%s is larger than the training split (%d samples): each batch "
            "holds the %d samples there are",
            training_args.per_device_train_batch_size,
            f" x {training_args.world_size} processes" if training_args.world_size > 1 else "",
            samples,
            samples,
        )


def wise_ft_start(model: torch.nn.Module, training_args: VlfitTrainingArguments) -> dict[str, torch.Tensor] | None:
    """A copy of the starting weights when ``--wise_ft_alpha`` will mix them into the trained ones, else None
    (``vlfit.arguments.flag_rules`` refused the runs it cannot mix)."""
    if training_args.wise_ft_alpha is None or not training_args.do_train:
        return None
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def with_lora_adapters(
    model: torch.nn.Module,
    spec: ModelSpec,
    model_args: ModelArguments,
    training_args: VlfitTrainingArguments,
    lora: LoraSettings,
) -> torch.nn.Module:
    """``model`` with LoRA adapters (``vlfit.models.lora``), their base recorded where a reload finds it: the
    checkpoint, or for a preset its initial weights, saved in ``<output_dir>/base_model``."""
    frozen = model_args.frozen_towers()
    initial = copy.deepcopy(model) if spec.checkpoint is None else None
    heads = trained_heads(spec.family, training_args.objective)
    adapted = apply_lora(spec.family, model, lora, frozen, heads)  # refuses bad targets before anything is written
    if initial is not None:
        base = BASE_MODEL_DIR
        if training_args.do_train and training_args.process_index == 0:
            folder = os.path.join(training_args.output_dir, BASE_MODEL_DIR)  # a checkpoint of its own
            initial.save_pretrained(folder)
            save_inputs(spec, folder)
    else:
        checkpoint = str(spec.checkpoint)
        base = os.path.abspath(checkpoint) if os.path.isdir(checkpoint) else checkpoint
    for config in adapted.peft_config.values():
        config.base_model_name_or_path = base
    trainable, total = trainable_parameters(adapted)
    logger.info("LoRA rank %d on %s: %d of %d parameters train (%.2f%%)", lora.r, ", ".join(lora.targets) or
                "every tower", trainable, total, 100 * trainable / total)  # fmt: skip
    return adapted


def later_unfreezing(
    model: torch.nn.Module,
    family: ModelFamily,
    model_args: ModelArguments,
    training_args: VlfitTrainingArguments,
) -> UnfreezeCallback | None:
    """What trains the towers ``--freeze`` froze from ``--unfreeze_after_steps`` on (their parameters with the step),
    or None."""
    if model_args.unfreeze_after_steps is None or not training_args.do_train:
        return None
    if training_args.world_size > 1:
        raise ConfigError(
            "--unfreeze_after_steps runs on one process only: DDP fixes at wrapping time which parameters it "
            "averages, so towers unfrozen later would drift apart between processes"
        )
    frozen = model_args.frozen_towers()
    parameters = [p for name, p in model.named_parameters() if not p.requires_grad and group_of(family, name) in frozen]
    if not parameters:
        return None
    return UnfreezeCallback(parameters, int(model_args.unfreeze_after_steps), ", ".join(frozen))


def _step_memory(
    pipeline: InputPipeline, step: str, batch_flag: str, training_args: VlfitTrainingArguments
) -> AbstractContextManager[None]:
    """A step that runs out of memory, as one line naming the flags that set its size, with the run's values."""
    inputs = pipeline.inputs
    sizes = {batch_flag: getattr(training_args, batch_flag), "max_num_patches": inputs.max_num_patches,
             "max_seq_length": inputs.max_seq_length}  # fmt: skip
    square = f"its images are {inputs.image_size} px, the model's own size" if inputs.max_num_patches is None else ""
    return out_of_memory_in_one_line(step, sizes, square)


def run(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: VlfitTrainingArguments,
    setup: RunSetup | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    command_line: str | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Train (``--do_train``) and/or evaluate (``--do_eval``) as the arguments say.

    Args:
        model_args: The model flags.
        data_args: The data flags.
        training_args: The training flags.
        setup: What ``setup_run`` made of the same arguments (made here when None).
        callbacks: More Trainer callbacks (``vlfit search`` reports each evaluation to its trial through one).
        command_line: The command that started the run, for the model card (``README.md``) a training run writes.
        state_dict: Weights that replace the model's after it is built (``vlfit wise-ft`` evaluates each
            interpolation of two models through it).

    Returns:
        The train metrics (prefixed ``train_``) and eval metrics (prefixed ``eval_``) that were computed.

    Raises:
        TrainingPreempted: SIGTERM or SIGINT stopped training; the message names the checkpoint saved at the stop.
        TooManyBadSamplesError: more than ``--max_bad_fraction`` of the samples read were bad.
        BadSampleError: a bad sample under ``--bad_sample_policy raise``.
    """
    if setup is None:
        setup = setup_run(model_args, data_args, training_args)
    else:  # made for other flags (a search trial's, a wise-ft alpha's): these are checked for the setup's task
        check_flag_rules(model_args, data_args, training_args, task=setup.task)
    train_source, eval_source, pipeline = setup.train_source, setup.eval_source, setup.pipeline
    describe_launch(training_args, len(train_source) if train_source is not None else None)
    if setup.train_stream is not None:
        train_dataset: Any = pipeline.stream_dataset(setup.train_stream, train=True)
    else:
        train_dataset = pipeline.dataset(train_source, train=True) if train_source is not None else None
    set_seed(training_args.seed)  # the same initial weights whatever ran since setup (e.g. a worker probe)
    model = build_model(setup.spec, **model_args.build_keywords())
    if state_dict is not None:
        model.load_state_dict(state_dict)
    if training_args.do_train and model_args.logit_scale_init_value is not None:
        set_logit_scale(model, model_args.logit_scale_init_value)  # a resumed run then loads its trained value
    family = setup.spec.family
    if training_args.do_train and setup.spec.inputs.matryoshka_dims:  # sizes the model's embedding can hold
        check_prefix_sizes(setup.spec.inputs.matryoshka_dims, _embedding_size(family, model, setup.spec))
    unfreeze = later_unfreezing(model, family, model_args, training_args)
    lora = model_args.lora_settings()
    starting_weights = wise_ft_start(model, training_args)  # before the objective adds a head
    model = prepare_model_for_objective(model, family, training_args.objective, train=training_args.do_train)
    if lora is not None:
        model = with_lora_adapters(model, setup.spec, model_args, training_args, lora)
    train_sampler = training_sampler(train_source, setup.spec.inputs, data_args, training_args)
    trainer = trainer_class(family, VlfitTrainer)(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=pipeline.dataset(eval_source, train=False) if eval_source is not None else None,
        processing_class=saved_tokenizer(setup.spec),  # what the Trainer saves beside every checkpoint
        pipeline=pipeline,
        family=with_matryoshka(family, training_args.matryoshka_sizes(), training_args.matryoshka_prefix_weight),
        eval_pool_size=data_args.eval_pool_size,
        max_bad_fraction=data_args.max_bad_fraction,
        unfreeze=unfreeze,
        train_sampler=train_sampler,
        zeroshot_sets=setup.zeroshot_sets,
        rerank_top_k=data_args.rerank_top_k,
    )
    configure_rerank(trainer, model_args, data_args, training_args)  # the weight evaluations fuse with, or sweep
    preemption = PreemptionCallback()
    trainer.add_callback(preemption)
    for callback in callbacks:
        trainer.add_callback(callback)
    logger.info(
        "model %s (%s): %.1fM parameters, images %s, pipeline %s, %s",
        setup.spec.description,
        family.name,
        sum(p.numel() for p in model.parameters()) / 1e6,
        pipeline.inputs.image_input,
        pipeline.description,
        f"{len(train_source)} training samples"
        if train_source is not None
        else "streamed training data"
        if setup.train_stream is not None
        else "no training",
    )
    logger.info("CPU: %s", cpu_info().describe())  # what decides bf16's speed here (vlfit.efficiency.cpu)

    results: dict[str, Any] = {}
    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint  # vlfit.training.output_dir decided it
        if trainer.flops_per_sample is not None:
            run_peak(training_args)  # measured now, on a device the run does not load yet (kept for the end)
        try:
            with _step_memory(pipeline, "a training step", "per_device_train_batch_size", training_args):
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
        if starting_weights is not None:
            model.load_state_dict(interpolate(starting_weights, model.state_dict(), training_args.wise_ft_alpha))
        bad, read = trainer.judge_whole_run()  # every process's, summed; a short run that lost too much stops here
        trainer.save_model()
        if trainer.is_world_process_zero():
            save_image_processor(setup.spec, training_args.output_dir)
        metrics = dict(train_result.metrics)
        if not metrics.get("total_flos"):  # the Trainer counts no FLOPs for these models; train_flops_* do
            metrics.pop("total_flos", None)
        throughput = trainer.throughput.total()
        metrics["train_data_wait_share"] = throughput["data_wait_share"]
        metrics.update({f"train_{name}": value for name, value in trainer.padded_patches.total().items()})
        if training_args.throughput_warmup_steps:  # the Trainer's own figure counts the warm-up steps too
            metrics["train_samples_per_second"] = throughput["samples_per_second"]
        if trainer.flops_per_sample is not None:
            efficiency = compute_efficiency(trainer.flops_per_sample, throughput["samples_per_second"], training_args)
            metrics.update(efficiency.metrics("train_"))
            logger.info("compute: %s", efficiency.describe())
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
        if eval_source is not None:  # a minute or more on a large split, without a bar under --disable_tqdm
            logger.info("evaluating on %d samples of the evaluation split", len(eval_source))
        with _step_memory(pipeline, "an evaluation step", "per_device_eval_batch_size", training_args):
            metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if training_args.do_train and trainer.is_world_process_zero():
        spec = setup.spec
        write_model_card(
            training_args.output_dir,
            family_name=family.name,
            base_model=spec.checkpoint,
            preset=spec.preset,
            datasets=[d for d in (data_args.dataset_name, data_args.train_file) if d],
            metrics=results,
            command_line=command_line,
            adapters=lora is not None,
            mix=None if starting_weights is None else WiseFtMix(training_args.wise_ft_alpha),
            answers=model_answers(spec.config),
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return results
