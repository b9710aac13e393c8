"""``transformers.Trainer`` fed by vlfit's input pipeline, with data-wait accounting and retrieval evaluation.

The Trainer (through accelerate) keeps owning distributed sampling, mixed precision, the model's placement and
checkpoints; the input pipeline owns the placement of batches. vlfit hooks in at these points:

- ``get_train_dataloader`` / ``get_eval_dataloader`` ask the ``InputPipeline`` for the loader (the only place
  vlfit builds one) and hand it to accelerate through ``shard_loader``: sharded across processes and seeded as
  the Trainer would have it, but with its batches left on the host.
- ``get_batch_samples`` is the one place the training loop takes batches: through the pipeline's device feed,
  which copies each host batch to the device once and normalizes it there (on CUDA the next one's copy and device
  stage run on a side stream), and the time blocked there is data wait. ``_prepare_inputs`` moves nothing that
  the feed already staged.
- ``compute_loss`` is the model family's contrastive loss, with local or global negatives; the run's first
  ``training_step`` also counts its FLOPs (``flops_per_sample``, for TFLOP/s and MFU).
- ``evaluate`` computes recall@k and matching accuracy instead of a validation loss
  (``vlfit.training.evaluation_metrics``).
- A streamed training split (``StreamingImageTextDataset``) bypasses accelerate's sharding (the stream splits its
  shards over processes itself); ``get_batch_samples`` marks each batch's items consumed, checkpoints save the
  stream's position and a resume loads it instead of skipping batches (``vlfit.training.stream_epochs``). A
  stream whose server becomes unreachable stops there: a checkpoint at the last completed step, then
  ``StreamSourceLost`` (``vlfit.training.preemption``).

It also keeps the run's ledger of bad samples (reported in each ``Batch``: counted in the logs, saved in
checkpoints, bounded by ``--max_bad_fraction``) and writes checkpoints atomically: each is written into a hidden
staging folder and renamed into place once complete (``vlfit.training.checkpoint_saving``), so a kill during
saving never leaves a ``checkpoint-N`` folder that resuming (``get_last_checkpoint``) would take for a complete one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence, Sized
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch.utils.data import Sampler, SequentialSampler
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint, has_length, seed_worker

from vlfit.data.batch import Batch
from vlfit.data.loader_workers import stop_loader_workers
from vlfit.data.pipeline import DeviceFeed, InputPipeline, LoaderSettings, shard_loader
from vlfit.data.stream import ShardStream, SourceUnreachableError
from vlfit.data.stream.dataset import StreamingImageTextDataset
from vlfit.efficiency.flops import count_flops
from vlfit.errors import ConfigError
from vlfit.evaluation.rerank import check_rerank
from vlfit.evaluation.zeroshot import ZeroShotSet
from vlfit.models.family import LossScope, ModelFamily
from vlfit.models.input_spec_file import save_input_settings
from vlfit.models.trainable import temporarily_trainable
from vlfit.training.bad_sample_accounting import BadSampleAccounting
from vlfit.training.bad_sample_ledger import BadSampleLedger
from vlfit.training.checkpoint_saving import AtomicCheckpointSaving
from vlfit.training.console_log import CONSOLE_CALLBACKS
from vlfit.training.evaluation_metrics import evaluation_metrics
from vlfit.training.fsdp import enable_fsdp_on_cpu, reshape_scalar_parameters, scalar_state_dict
from vlfit.training.itm_objective import CONTRASTIVE, TrainingObjective
from vlfit.training.lean_step import LeanStep
from vlfit.training.master_weights import MasterWeights
from vlfit.training.padded_patches import PaddedPatchMeter
from vlfit.training.preemption import StreamSourceLost
from vlfit.training.stream_epochs import StreamEpochs, agreed_batches, load_stream_state, save_stream_state
from vlfit.training.throughput import ThroughputMeter
from vlfit.training.unfreeze import UnfreezeCallback

logger = logging.getLogger(__name__)


class VlfitTrainer(LeanStep, BadSampleAccounting, AtomicCheckpointSaving, Trainer):
    """A Trainer for contrastive image-text fine-tuning.

    Args:
        pipeline: Builds the loaders and brings batches to the device.
        family: The model family (its contrastive loss and unimodal encoders).
        eval_pool_size: Candidate pool for recall@k (``None``: the whole split).
        max_bad_fraction: Stop training once more than this fraction of the samples read were bad.
        unfreeze: Trains the towers ``--freeze`` froze from ``--unfreeze_after_steps`` on; its parameters are in
            the optimizer from the start (``vlfit.training.unfreeze``).
        train_sampler: The training order (``--caption_sampling one_per_image``); ``None``: the Trainer's shuffle.
        zeroshot_sets: Labelled splits classified zero-shot at every evaluation (``--zeroshot_dataset``).
        rerank_top_k: Re-rank each query's top K by the matching head in evaluation (``--rerank_top_k``).
        *args, **kwargs: As ``transformers.Trainer`` (``train_dataset`` / ``eval_dataset`` are the pipeline's
            datasets).
    """

    def __init__(
        self,
        *args: Any,
        pipeline: InputPipeline,
        family: ModelFamily,
        eval_pool_size: int | None = None,
        max_bad_fraction: float = 1.0,
        unfreeze: UnfreezeCallback | None = None,
        train_sampler: Sampler[int] | None = None,
        zeroshot_sets: Sequence[ZeroShotSet] = (),
        rerank_top_k: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_rerank(self.model, rerank_top_k, eval_pool_size)  # before training, not at its end
        self.rerank_top_k = rerank_top_k
        self.objective = TrainingObjective(getattr(self.args, "objective", CONTRASTIVE), self.args.seed)
        self.train_sampler = train_sampler
        self.zeroshot_sets = list(zeroshot_sets)
        self.unfreeze = unfreeze
        self.pipeline = pipeline
        self.family = family
        self.eval_pool_size = eval_pool_size
        self.throughput = ThroughputMeter(self.args.world_size)
        self.padded_patches = PaddedPatchMeter()
        split_size = len(self.train_dataset) if isinstance(self.train_dataset, Sized) else None
        self.bad_samples = BadSampleLedger(max_bad_fraction, log=True, split_size=split_size)
        self.flops_per_sample: float | None = None
        self._scalar_parameters: list[str] = []  # reshaped for fully_shard (FSDP runs)
        self._feed_source: Any = None
        self._feed: DeviceFeed | None = None
        self._feed_done = False  # a streamed epoch ran out on some process (vlfit.training.stream_epochs)
        self._stream_epochs: StreamEpochs | None = None
        self._resumed_batches = 0  # batches of the stream's epoch a resumed checkpoint had consumed
        self.add_callback(_CountOptimizerSteps(self))
        if unfreeze is not None:
            self.add_callback(unfreeze)
        for plain, compact in CONSOLE_CALLBACKS:  # one line per log, not the dict (vlfit.training.console_log)
            if self.pop_callback(plain) is not None:
                self.add_callback(compact)

    @property
    def train_stream(self) -> ShardStream | None:
        """The stream of a streamed training split (``None`` for a map-style one)."""
        return self.train_dataset.stream if isinstance(self.train_dataset, StreamingImageTextDataset) else None

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        # Parameters --unfreeze_after_steps trains later are in the optimizer from the start (vlfit.training.unfreeze).
        with temporarily_trainable(self.unfreeze.parameters if self.unfreeze is not None else ()):
            optimizer = super().create_optimizer(*args, **kwargs)
        if getattr(self.args, "bf16_weights", False) and self.master_weights is None:
            # The model is still fp32 here (a resumed run's checkpoint loaded into it): the copies start from that.
            self.master_weights = MasterWeights(self.model, optimizer)
        return optimizer

    @property
    def _model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is not None and enable_fsdp_on_cpu(self.accelerator, self.args.fsdp_plugin_args):
            self.is_fsdp_enabled = True

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        # The clock starts with training, not with construction; --throughput_warmup_steps leaves out the first steps.
        self.throughput = ThroughputMeter(self.args.world_size, getattr(self.args, "throughput_warmup_steps", 0))
        self.padded_patches = PaddedPatchMeter()
        stream = self.train_stream
        self.bad_samples = BadSampleLedger(
            self.bad_samples.max_bad_fraction,
            log=True,
            split_size=self.bad_samples.split_size,
            shard_sources=[(s.spec or "the stream", s.urls) for s in stream.sources] if stream is not None else (),
        )
        self.family.prepare_for_training(self.model)
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if stream is not None:
            # A stream resumes from the position the checkpoint holds, not by reading and dropping its batches.
            self.args.ignore_data_skip = True
        if isinstance(checkpoint, str):
            # Batches before the checkpoint are skipped without being read: their bad samples come from the ledger.
            self.bad_samples.load(checkpoint, self.args.process_index)
            if stream is not None:
                self._resumed_batches = load_stream_state(stream, checkpoint, self.args.process_index)
        if self.is_fsdp_enabled and not self._scalar_parameters:
            self._scalar_parameters = reshape_scalar_parameters(self.model)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as error:
            stop_loader_workers(error.__traceback__)
            raise
        finally:
            self._close_feed()
            if self.master_weights is not None:  # what comes after training (evaluation, saving) sees fp32 weights
                self.master_weights.release()
                self.master_weights = None

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        if self._scalar_parameters:
            if state_dict is None:
                state_dict = self.accelerator.get_state_dict(self.model)
            state_dict = scalar_state_dict(state_dict, self._scalar_parameters)
        with self.master_weights.fp32() if self.master_weights is not None else nullcontext():  # --bf16_weights
            super()._save(output_dir, state_dict=state_dict)
        # The inputs the run trains on, beside the final model and every checkpoint-N: what every door reads.
        save_input_settings(self.pipeline.inputs, output_dir or self.args.output_dir)

    def _close_feed(self) -> None:
        """Let go of the training batches' iterator, so its loader workers stop now, while this process is in a
        state to stop them. Kept until garbage collection (the trainer is in reference cycles), they were stopped
        from inside whatever ran next, where each worker took the 5 s of torch's shutdown timeout to exit."""
        self._feed_source = self._feed = None

    # ------------------------------------------------------------------------------------------------ loaders

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ConfigError("training needs a training split")
        make_loader = partial(
            self.pipeline.loader,
            self.train_dataset,
            batch_size=self._train_batch_size,
            settings=LoaderSettings.from_training_args(self.args),
            worker_init_fn=partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            ),
        )
        stream = self.train_stream
        if stream is not None:
            # The stream splits its shards over processes and workers itself: accelerate neither shards nor
            # dispatches it, and a resumed run skips no batches (ignore_data_skip).
            self._stream_epochs = StreamEpochs(make_loader(generator=torch.Generator()), stream, self._resumed_batches)
            return self._stream_epochs
        sampler = self.train_sampler if self.train_sampler is not None else self._get_train_sampler()
        return shard_loader(make_loader(sampler=sampler), self.accelerator)

    def _get_eval_sampler(self, eval_dataset: Any) -> Sampler[int] | None:
        # Evaluation reads its split in order, whatever --train_sampling_strategy says (the Trainer's own would group
        # evaluation by length too); across processes accelerate shards the loader in order.
        if eval_dataset is None or not has_length(eval_dataset) or self.args.world_size > 1:
            return None
        return SequentialSampler(eval_dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError("evaluation needs an evaluation split")
        loader = self.pipeline.loader(
            dataset,
            batch_size=self.args.eval_batch_size,
            # Retrieval scores every sample: --dataloader_drop_last is for training batches only.
            settings=LoaderSettings.from_training_args(self.args, drop_last=False),
            sampler=self._get_eval_sampler(dataset),
        )
        return shard_loader(loader, self.accelerator)

    # ------------------------------------------------------------------------------------------------ batches

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        if self._feed_source is not epoch_iterator:
            self._feed_source = epoch_iterator
            self._feed = self.pipeline.feed(epoch_iterator, self._model_dtype, train=True)
            self._feed_done = False
        assert self._feed is not None
        batches: list[Batch] = []
        waited = 0.0
        lost: SourceUnreachableError | None = None
        for _ in range(num_batches if not self._feed_done else 0):
            try:
                batches.append(next(self._feed))
            except StopIteration:
                break
            except SourceUnreachableError as err:
                lost = err
                break
            waited += self._feed.last_wait
        stream = self.train_stream
        if stream is not None:
            agreed = len(batches) if lost is None else -1  # -1: this process's stream lost its source
            if not self._feed_done and self.args.world_size > 1:
                agreed = agreed_batches(agreed, self.args.device)
            if agreed < 0:
                self._stop_for_lost_source(lost)
            del batches[agreed:]
            self._feed_done = self._feed_done or len(batches) < num_batches
            for batch in batches:  # used by the coming step: a checkpoint after it resumes after them
                for position in batch.stream_positions:
                    stream.mark_consumed(position)
            if self._stream_epochs is not None:
                self._stream_epochs.batches += len(batches)
        self.throughput.add(waited, sum(len(batch) for batch in batches))
        for batch in batches:
            self.bad_samples.add(batch.bad_samples, rows=len(batch), step=self.state.global_step + 1)
            self.padded_patches.add(batch)
        self._check_bad_fraction()
        # The contrastive loss is a mean over the batch: no token count to normalize by (num_items_in_batch).
        return batches, None

    def _stop_for_lost_source(self, error: SourceUnreachableError | None) -> None:
        """Save a checkpoint at the last completed step, as a stop signal does, and raise ``StreamSourceLost``.

        The batches read for the coming step are not marked consumed (nor their bad samples counted): the stream
        position saved is the one after the last step trained, and the resumed run reads them again. Every process
        comes here at the same step (``agreed_batches`` carried the loss), as saving is a collective.
        """
        step = self.state.global_step
        checkpoint = None
        if step > 0:
            checkpoint = os.path.join(self.args.output_dir, self._checkpoint_name)
            if not os.path.isdir(checkpoint):  # not saved at this step already (--save_steps)
                self.store_flos()
                self._save_checkpoint(self.model, trial=None)
        reason = str(error) if error is not None else "another process's stream could not reach its server"
        logger.error("the training stream stopped at step %d: %s", step, reason)
        raise StreamSourceLost(reason, checkpoint, step) from error

    def _prepare_inputs(self, inputs: Batch) -> Batch:  # type: ignore[override]
        # Batches from get_batch_samples are on the device already and come back as they are; only a host batch
        # from elsewhere goes through the device stage.
        return self.pipeline.to_device(inputs, self._model_dtype, train=self.model.training)

    def training_step(self, model: torch.nn.Module, inputs: Batch, *args: Any, **kwargs: Any) -> torch.Tensor:
        def step() -> torch.Tensor:
            if self._step_is_plain or (self._gradient_cache_chunk_size and len(inputs)):
                return self._own_step(model, inputs)
            return super(VlfitTrainer, self).training_step(model, inputs, *args, **kwargs)

        if self.flops_per_sample is not None or not len(inputs):
            return step()
        # The run's first step is counted (forward and backward, at this batch's real shapes): FLOPs per sample.
        # With gradient caching that includes its second forward pass: the FLOPs the hardware does.
        loss, flops = count_flops(step)
        self.flops_per_sample = flops / len(inputs)
        return loss

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Batch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if return_outputs:
            raise NotImplementedError("vlfit evaluates by retrieval (evaluate), not by prediction outputs")
        if self.objective.uses_itm:  # --objective contrastive+itm or itm (vlfit.training.itm_objective)
            return self.objective.loss(
                self.family,
                model,
                inputs.inputs,
                step=self.state.global_step,
                scope=LossScope.of(self.args),
            )
        return self.family.contrastive_loss(model, inputs.inputs, LossScope.of(self.args))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.throughput.window())
            logs.update(self.padded_patches.window())  # NaFlex runs: the share of patches that are padding
            logs["bad_samples"] = self.bad_samples.count
            logs.update(self.objective.window())  # each term of --objective contrastive+itm, and ITM accuracy
        super().log(logs, start_time)

    def _save_data_position(self, folder: str) -> None:
        """This process's part of a checkpoint beside the Trainer's: its bad-sample ledger and its stream position."""
        self.bad_samples.save(folder, self.args.process_index)
        if self.train_stream is not None:
            batches = self._stream_epochs.batches if self._stream_epochs is not None else 0
            save_stream_state(self.train_stream, folder, self.args.process_index, batches)

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        metrics = evaluation_metrics(self, self.get_eval_dataloader(eval_dataset))
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class _CountOptimizerSteps(TrainerCallback):
    """Tells the throughput meter where each optimizer step ends (for ``--throughput_warmup_steps``), and for a
    streamed split sets the epoch the step logs: the stream's epoch plus the batches read in it over the Trainer's
    steps per epoch (``max_steps`` for a loader without length), so that a resumed run logs what the uninterrupted
    one did (the Trainer's own count restarts at the resume)."""

    def __init__(self, trainer: VlfitTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.throughput.step()
        epochs = self.trainer._stream_epochs
        if epochs is not None and args.max_steps > 0:
            state.epoch = epochs.stream.epoch + epochs.batches / (args.max_steps * args.gradient_accumulation_steps)
