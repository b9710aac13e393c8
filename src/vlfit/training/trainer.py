"""``transformers.Trainer`` with vlfit's device stage, data-wait accounting and retrieval evaluation.

The Trainer (through accelerate) keeps owning device placement, distributed sampling, mixed precision and
checkpoints; vlfit hooks in at these points:

- ``get_batch_samples`` is the one place the training loop calls ``next()`` on the loader: time spent there is
  data wait. On CUDA the device stage of the next batch is started there too, on a side stream.
- ``_prepare_inputs`` runs the device stage (uint8 -> normalized float, flip, or nvJPEG decode) on CPU runs.
- ``evaluate`` computes recall@k and matching accuracy instead of a validation loss.
- ``compute_loss`` is BridgeTower's own loss, or with ``--contrastive_negatives global`` the same loss over the
  embeddings of every process (``vlfit.training.contrastive_loss``).

It also keeps the run's ledger of bad samples (reported in the batches, see ``vlfit.data.bad_samples``: counted
in the logs, saved in checkpoints, bounded by ``--max_bad_fraction``) and writes checkpoints atomically: each is
written into a hidden staging folder and renamed into place once complete, so a kill during saving never leaves
a ``checkpoint-N`` folder that resuming (``get_last_checkpoint``) would take for a complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from vlfit.data.bad_samples import BAD_SAMPLES_REPORT, BadSampleLedger, TooManyBadSamplesError
from vlfit.data.device_stage import CudaPrefetcher, DeviceStage
from vlfit.evaluation.retrieval import EmbeddedSplit, evaluate_retrieval
from vlfit.training.contrastive_loss import contrastive_loss, expose_logit_scale
from vlfit.training.throughput import ThroughputMeter

MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values")
# Checkpoints are staged in ``<output_dir>/.partial-checkpoint-N/checkpoint-N``: the name matches neither
# ``get_last_checkpoint``'s ``^checkpoint-\d+$`` nor the ``checkpoint-*`` glob of checkpoint rotation.
STAGING_PREFIX = ".partial-"

logger = logging.getLogger(__name__)


class VlfitTrainer(Trainer):
    """A Trainer for contrastive image-text fine-tuning.

    Args:
        device_stage: Turns collated batches into model inputs on the device.
        max_seq_length: Truncation length for caption choices in evaluation.
        eval_pool_size: Candidate pool for recall@k (``None``: the whole split).
        max_bad_fraction: Stop training once more than this fraction of the samples read were bad.
        *args, **kwargs: As ``transformers.Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        device_stage: DeviceStage,
        max_seq_length: int = 128,
        eval_pool_size: int | None = None,
        max_bad_fraction: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.device_stage = device_stage
        self.max_seq_length = max_seq_length
        self.eval_pool_size = eval_pool_size
        self.throughput = ThroughputMeter(self.args.world_size)
        self.bad_samples = BadSampleLedger(max_bad_fraction)
        self._prefetch_source: Any = None
        self._prefetcher: CudaPrefetcher | None = None
        self._staging_run_dir: str | None = None

    @property
    def _model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        self.throughput = ThroughputMeter(self.args.world_size)  # the clock starts with training, not with construction
        self.bad_samples = BadSampleLedger(self.bad_samples.max_bad_fraction)
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, str):
            # Batches before the checkpoint are skipped without being read: their bad samples come from the ledger.
            self.bad_samples.load(checkpoint, self.args.process_index)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        start = time.perf_counter()
        if self.args.device.type == "cuda":
            if self._prefetch_source is not epoch_iterator:
                self._prefetch_source = epoch_iterator
                self._prefetcher = CudaPrefetcher(
                    epoch_iterator, self.device_stage, self.args.device, self._model_dtype
                )
            epoch_iterator = self._prefetcher
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.throughput.add(time.perf_counter() - start, sum(len(b["input_ids"]) for b in batches))
        self._account_bad_samples(batches)
        return batches, num_items

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if not inputs.get("_device_ready"):
            inputs = super()._prepare_inputs(inputs)
            inputs = self.device_stage(inputs, self.args.device, self._model_dtype, train=self.model.training)
            if "device_bad_samples" in inputs and self.model.training:
                # Found at device decode, after get_batch_samples counted the batch's rows: only the drops add.
                self.bad_samples.add(inputs.pop("device_bad_samples"), rows=0, step=self._reading_step, stage="device")
                self._check_bad_fraction()
        return inputs

    @property
    def _reading_step(self) -> int:
        """The 1-based step whose batches are being read."""
        return self.state.global_step + 1

    def _account_bad_samples(self, batches: list[dict[str, Any]]) -> None:
        for batch in batches:
            bad = batch.pop("bad_samples", [])
            device_bad = batch.pop("device_bad_samples", [])  # present when the device stage ran already (CUDA)
            rows = len(batch["input_ids"]) + len(device_bad)
            for sample_id, reason in self.bad_samples.add(bad, rows=rows, step=self._reading_step):
                logger.warning("skipped bad sample %s (replaced in its batch): %s", sample_id, reason)
            self.bad_samples.add(device_bad, rows=0, step=self._reading_step, stage="device")
        self._check_bad_fraction()

    def _check_bad_fraction(self) -> None:
        try:
            self.bad_samples.check()
        except TooManyBadSamplesError:
            self.write_bad_samples_report()
            raise

    def bad_sample_totals(self) -> tuple[int, int]:
        """Bad samples skipped and samples read, summed over every process (a collective in distributed runs)."""
        totals = torch.tensor(
            [self.bad_samples.count, self.bad_samples.samples_read], dtype=torch.long, device=self.args.device
        )
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        return int(totals[0]), int(totals[1])

    def write_bad_samples_report(self) -> str:
        """Write this process's bad samples to ``bad_samples.jsonl`` in the output folder; returns the path."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        name = BAD_SAMPLES_REPORT
        if self.args.process_index > 0:
            stem, ext = os.path.splitext(name)
            name = f"{stem}_{self.args.process_index}{ext}"
        path = os.path.join(self.args.output_dir, name)
        self.bad_samples.write_report(path)
        return path

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        model_inputs = {key: inputs[key] for key in MODEL_INPUTS}
        if getattr(self.args, "contrastive_negatives", "local") != "global":
            outputs = model(**model_inputs, return_loss=True)
            return (outputs.loss, outputs) if return_outputs else outputs.loss
        expose_logit_scale(self.accelerator.unwrap_model(model))
        outputs = model(**model_inputs, return_loss=False)
        # DataParallel (several GPUs, one process) stacks one copy of the scalar per replica.
        logit_scale = outputs.logit_scale.mean()
        loss = contrastive_loss(
            outputs.text_embeds, outputs.image_embeds, outputs.cross_embeds, logit_scale, gather=True
        )
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.throughput.window())
            logs["bad_samples"] = self.bad_samples.count
        super().log(logs, start_time)

    def _get_output_dir(self, trial: Any) -> str:
        # While a checkpoint is being saved, the Trainer writes it under the staging folder.
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Save a checkpoint into a staging folder, then rename it to ``checkpoint-N`` (atomic on one filesystem).

        The checkpoint also holds this process's bad-sample ledger. With ``--push_to_hub`` the Trainer uploads
        the folder in the background while training goes on, so it is written in place as the Trainer does.
        """
        if self.args.push_to_hub:
            super()._save_checkpoint(model, trial)
            self.bad_samples.save(
                os.path.join(self._get_output_dir(trial), self._checkpoint_name), self.args.process_index
            )
            return
        run_dir = self._get_output_dir(trial)
        name = self._checkpoint_name
        final_dir = os.path.join(run_dir, name)
        staging_root = os.path.join(run_dir, STAGING_PREFIX + name)
        staged_dir = os.path.join(staging_root, name)
        if self.args.should_save:
            remove_partial_checkpoints(run_dir)
            os.makedirs(staged_dir)
        self.accelerator.wait_for_everyone()
        self._staging_run_dir = staging_root
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_run_dir = None
        os.makedirs(staged_dir, exist_ok=True)
        self.bad_samples.save(staged_dir, self.args.process_index)
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, ledgers, shards)
        if self.args.should_save:
            if self.state.best_model_checkpoint == staged_dir:
                # The Trainer recorded where it just wrote the best checkpoint: record where it will stay instead.
                self.state.best_model_checkpoint = final_dir
                self.state.save_to_json(os.path.join(staged_dir, "trainer_state.json"))
            _fsync_tree(staged_dir)
            if os.path.isdir(final_dir):
                # The same step saved twice (a stop requested on a save step): swap, then drop the old copy.
                os.replace(final_dir, os.path.join(staging_root, "previous"))
            os.replace(staged_dir, final_dir)
            _fsync_dir(run_dir)
            shutil.rmtree(staging_root, ignore_errors=True)
            # The Trainer rotated inside the staging folder (one checkpoint: nothing to do); rotate for real.
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    @property
    def _checkpoint_name(self) -> str:
        return f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        # Retrieval scores every sample: --dataloader_drop_last is for training batches only.
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.args.dataloader_drop_last = drop_last

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        metrics, skipped = evaluate_retrieval(
            self.model,
            self.get_eval_dataloader(eval_dataset),
            stage=self.device_stage,
            device=self.args.device,
            tokenizer=self.processing_class,
            max_seq_length=self.max_seq_length,
            pool_size=self.eval_pool_size,
            autocast=self.autocast_smart_context_manager,
            gather_parts=gather_parts if self.accelerator.num_processes > 1 else None,
        )
        if self.is_world_process_zero():
            for sample_id, reason in skipped:
                logger.warning("evaluation left out bad sample %s: %s", sample_id, reason)
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


def gather_parts(part: EmbeddedSplit) -> list[EmbeddedSplit]:
    """Every process's evaluation part, in rank order (a collective: every process calls it once)."""
    return gather_object([part])


def remove_partial_checkpoints(run_dir: str) -> list[str]:
    """Delete staging folders left by saves that were killed; returns what was removed."""
    if not os.path.isdir(run_dir):
        return []
    removed = []
    for entry in os.listdir(run_dir):
        if entry.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
            shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
            removed.append(entry)
    return removed


def _fsync_tree(folder: str) -> None:
    """Flush every file of ``folder`` to disk, so the rename never publishes data still in the page cache."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
