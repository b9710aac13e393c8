"""``transformers.Trainer`` with vlfit's device stage, data-wait accounting and retrieval evaluation.

The Trainer (through accelerate) keeps owning device placement, distributed sampling, mixed precision and
checkpoints; vlfit hooks in at three points:

- ``get_batch_samples`` is the one place the training loop calls ``next()`` on the loader: time spent there is
  data wait. On CUDA the device stage of the next batch is started there too, on a side stream.
- ``_prepare_inputs`` runs the device stage (uint8 -> normalized float, flip, or nvJPEG decode) on CPU runs.
- ``evaluate`` computes recall@k and matching accuracy instead of a validation loss.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import Trainer

from vlfit.data.device_stage import CudaPrefetcher, DeviceStage
from vlfit.evaluation.retrieval import evaluate_retrieval
from vlfit.training.throughput import ThroughputMeter

MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values")


class VlfitTrainer(Trainer):
    """A Trainer for contrastive image-text fine-tuning.

    Args:
        device_stage: Turns collated batches into model inputs on the device.
        max_seq_length: Truncation length for caption choices in evaluation.
        eval_pool_size: Candidate pool for recall@k (``None``: the whole split).
        *args, **kwargs: As ``transformers.Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        device_stage: DeviceStage,
        max_seq_length: int = 128,
        eval_pool_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.device_stage = device_stage
        self.max_seq_length = max_seq_length
        self.eval_pool_size = eval_pool_size
        self.throughput = ThroughputMeter()
        self._prefetch_source: Any = None
        self._prefetcher: CudaPrefetcher | None = None

    @property
    def _model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.throughput = ThroughputMeter()  # the clock starts with training, not with construction
        return super().train(*args, **kwargs)

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
        return batches, num_items

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if not inputs.get("_device_ready"):
            inputs = super()._prepare_inputs(inputs)
            inputs = self.device_stage(inputs, self.args.device, self._model_dtype, train=self.model.training)
        return inputs

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        outputs = model(**{key: inputs[key] for key in MODEL_INPUTS}, return_loss=True)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.throughput.window())
        super().log(logs, start_time)

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
        loader = self.get_eval_dataloader(eval_dataset)
        metrics = evaluate_retrieval(
            self.model,
            loader,
            stage=self.device_stage,
            device=self.args.device,
            tokenizer=self.processing_class,
            max_seq_length=self.max_seq_length,
            pool_size=self.eval_pool_size,
            autocast=self.autocast_smart_context_manager,
            gather=self.accelerator.gather_for_metrics if self.accelerator.num_processes > 1 else None,
        )
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
